"""What the front <-> engine channel's serializer costs per message: pickle (what
render/link.py sends) against msgspec's msgpack (what vLLM V1 sends), side by side.

    .venv/bin/python bench/channel_codec.py [--n 20000]

The messages of a turbo request as the channel carries them (the submit call and its reply, the
job's end with one 256x256 image, a step's metric, a GC pause), each encoded and decoded n
times; per message and serializer the median of 7 timings, in microseconds per round trip, and
the bytes on the wire. msgspec decodes the submit call into a typed Struct (it has no way to
carry the JobRequest dataclass untyped); images travel as frames of their own with either, so
neither copies them.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import timeit
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from render.jobs import JobRequest  # noqa: E402
from render.link import pack, unpack  # noqa: E402

REQUEST = JobRequest("a watercolor of a lighthouse, variation 3", "turbo", 4, 123, 0.0, 256, 256)
DESCRIBED = {
    "id": "job-9165983a8c774d11",
    "object": "image.generation.job",
    "state": "done",
    "tier": "turbo",
    "progress": 1.0,
    "created": 1796391143,
    "steps": 4,
    "step": 4,
    "seed": 123,
    "n": 1,
    "size": "256x256",
    "queue_wait_s": 0.0123,
    "elapsed_s": 0.1456,
}
MADE = {"id": DESCRIBED["id"], "submitted": 12345.6, "created": 1796391143.2, "describe": DESCRIBED}  # submit's answer
PNG = b"iVBORw0KGgo" * 24_000  # the size of a 256x256 tiny-model image, base64


class Submit(msgspec.Struct, array_like=True):
    kind: str
    id: int
    method: str
    request: JobRequest
    keep_images: bool


def messages() -> dict[str, tuple]:
    return {
        "submit call": ("call", 17, "submit", (REQUEST, False)),
        "its reply": (
            "reply",
            17,
            True,
            {"id": DESCRIBED["id"], "submitted": 1.5, "created": 2.5, "describe": DESCRIBED},
        ),
        "job end, 1 image": ("done", DESCRIBED["id"], "done", None, 12345.9, DESCRIBED, [pickle.PickleBuffer(PNG)]),
        "metric": ("metric", "observe_step", (0.031, ["turbo", "relax"])),
        "gc pause": ("gc", 2, 0.0123),
    }


def msgspec_codec(name: str, message: tuple):
    """(encode, decode) as msgspec would do it: the image as a frame beside the msgpack."""
    enc = msgspec.msgpack.Encoder()
    if name == "submit call":
        typed = Submit("call", 17, "submit", REQUEST, False)
        dec = msgspec.msgpack.Decoder(Submit)
        return (lambda: [enc.encode(typed)]), (lambda frames: dec.decode(frames[0]))
    untyped = msgspec.msgpack.Decoder()
    if name.startswith("job end"):
        head = message[:-1]
        return (lambda: [enc.encode(head), PNG]), (lambda frames: (*untyped.decode(frames[0]), frames[1:]))
    return (lambda: [enc.encode(message)]), (lambda frames: untyped.decode(frames[0]))


def microseconds(fn, n: int) -> float:
    return statistics.median(timeit.repeat(fn, number=n, repeat=7)) / n * 1e6


def main() -> int:
    from bench.record import record, variant_of

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="round trips per timing")
    args = ap.parse_args()
    print(f"encode + decode, us per message (median of 7 x n={args.n}); bytes besides the image frames")
    print(f"{'message':18} {'pickle':>8} {'msgspec':>8} {'ratio':>6} {'bytes':>12}")
    rows = []
    for name, message in messages().items():
        encode, decode = msgspec_codec(name, message)
        p = microseconds(lambda m=message: unpack(pack(m)), args.n)
        m = microseconds(lambda e=encode, d=decode: d(e()), args.n)
        size = f"{len(pack(message)[0])}/{len(encode()[0])}"
        print(f"{name:18} {p:8.2f} {m:8.2f} {p / m:5.1f}x {size:>12}")
        rows.append([name, round(p, 2), round(m, 2), round(p / m, 1), size])
    record(
        "channel_codec",
        variant=variant_of(ap, args),
        n=args.n,
        n_per="round trips per timing (median of 7 timings)",
        headline="pickle / msgspec per message: " + ", ".join(f"{r[0]} {r[1]}/{r[2]} us" for r in rows),
        figures={f"{r[0]} {codec} us": r[i] for r in rows for i, codec in ((1, "pickle"), (2, "msgspec"))},
        table={"columns": ["message", "pickle us", "msgspec us", "ratio", "bytes pickle/msgspec"], "rows": rows},
        notes="no target: it backs pickle on the front <-> engine channel (docs/worker.md, 'Why pickle')",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
