"""``kernelmix bench``: op speed and memory per mixer against length; JSON + PNG."""

from __future__ import annotations

import argparse

from .options import int_list, mixer_list, positive_int


def _op_bench(args: argparse.Namespace) -> int:
    from ..studies.bench import MIXER_NAMES, format_report, run_bench, write_report

    report = run_bench(
        mixers=tuple(args.mixers or MIXER_NAMES), lengths=tuple(args.lengths),
        decode_positions=tuple(args.decode_positions), batch=args.batch, heads=args.heads, head_dim=args.head_dim,
        num_features=args.num_features, chunk_size=args.chunk_size, device=args.device, dtype=args.dtype,
        autocast=args.autocast, repeats=args.repeats, memory=not args.no_memory, peers=tuple(p for p in args.peers.split(",") if p),
        peer_max_length=args.peer_max_length, progress=lambda text: print(f"  measuring {text}", flush=True),
    )
    written = write_report(report, args.out)
    print(format_report(report))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_command(sub) -> None:
    opbench = sub.add_parser(
        "bench", help="op speed and memory per mixer vs T (forward, forward+backward, decode); JSON + PNG",
    )
    opbench.add_argument("--mixers", type=mixer_list, default=None, help="comma-separated (default: all)")
    opbench.add_argument("--lengths", type=int_list, default=[256, 512, 1024, 2048, 4096], help="e.g. 256,1024,4096")
    opbench.add_argument("--decode-positions", type=int_list, default=[256, 1024, 4096])
    opbench.add_argument("--batch", type=positive_int, default=1)
    opbench.add_argument("--heads", type=positive_int, default=8)
    opbench.add_argument("--head-dim", type=positive_int, default=64)
    opbench.add_argument("--num-features", type=positive_int, default=128)
    opbench.add_argument("--chunk-size", type=positive_int, default=64)
    opbench.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the inputs' dtype")
    opbench.add_argument(
        "--autocast", choices=["bfloat16", "float16"], default=None,
        help="run the forward passes under torch.autocast in this dtype (fp32 inputs; needs --dtype float32)",
    )
    opbench.add_argument("--device", default="cpu")
    opbench.add_argument("--repeats", type=positive_int, default=3)
    opbench.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    opbench.add_argument("--out", default="runs/bench", help="directory for bench.json / bench.png (the committed runs: results/bench*)")
    opbench.add_argument(
        "--peers", default="", help="comma-separated peers measured in the same run: performer-pytorch, "
        "fla-deltaformer-naive, cubit-dense (skipped with a note when not installed)",
    )
    opbench.add_argument("--peer-max-length", type=positive_int, default=2048, help="largest T for the peers")
    opbench.set_defaults(func=_op_bench)
