# Versions the scripts share (sourced by setup.sh and lock.sh).
# torch is pinned apart from the lock: 2.13.0 is the CPU wheel these machines keep on disk;
# an unpinned torch pulls a CUDA build of GBs. pyproject.toml's [tool.uv.dependency-metadata]
# names the same version (tests/test_install_lock.py checks they agree).
TORCH_VERSION=2.13.0
# the resolver that writes requirements.lock (scripts/lock.sh)
UV_VERSION=0.13.9
