"""Commit subjects stay readable in `git log --oneline`: at most 72 characters, the why in the
body. Checked from the first commit that followed the rule (59b0ea8's child); older subjects
are history and stay as they are."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers import ROOT

RULE_SINCE = "59b0ea8"  # the last commit before the rule: every later subject keeps it
SUBJECT_MAX = 72


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)


def test_commit_subjects_since_the_rule_fit_72_characters():
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout")
    if _git("cat-file", "-e", f"{RULE_SINCE}^{{commit}}").returncode != 0:
        pytest.skip(f"{RULE_SINCE} not in this clone (shallow?)")
    log = _git("log", "--format=%h %s", f"{RULE_SINCE}..HEAD")
    assert log.returncode == 0, log.stderr
    long = [line for line in log.stdout.splitlines() if len(line.split(" ", 1)[1]) > SUBJECT_MAX]
    assert not long, f"subjects over {SUBJECT_MAX} characters (reword before pushing): {long}"
