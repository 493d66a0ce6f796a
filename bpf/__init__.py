"""eBPF C sources, loaded with bcc at run time (BPF(src_file=source('classifier.c')))."""

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def source(name: str) -> str:
    """Absolute path of a C source shipped in this package."""
    path = _HERE / name
    if not path.is_file():
        raise FileNotFoundError(f"BPF source {name} not found in {_HERE}")
    return str(path)
