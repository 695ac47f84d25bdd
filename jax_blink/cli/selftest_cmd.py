"""``jax-blink selftest``: check the native CUDA executor on this machine's GPUs (see
``jax_blink.gpu_selftest``); exit status 0 pass (recorded), 1 failure, 2 no GPU."""

from __future__ import annotations

from ._args import positive_int


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=positive_int, default=None,
                   help="ranks for the executor checks (default: one per GPU; 4 sharing one GPU when there is one)")
    p.add_argument("--no-record", action="store_true", help="do not record a pass")


def run(args) -> int:
    import os
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to the executor checks
    from ..gpu_selftest import selftest
    return selftest(nranks=args.ranks, record=not args.no_record).status
