"""The ``kernelmix`` command line: a thin shell over the library."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .demo import ERROR_BOUNDS, cubit_memory, describe, format_table, run_demo

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]

    print(
        f"kernelmix demo: every mixer on one random batch B={args.batch} T={args.length} H={args.heads} "
        f"d={args.head_dim} (random features m={args.num_features}), fast path in float32 vs float64 reference\n"
    )
    rows = run_demo(
        batch=args.batch, length=args.length, heads=args.heads, head_dim=args.head_dim,
        num_features=args.num_features, repeats=args.repeats, device=args.device, dtype=dtype,
    )
    print(format_table(rows))
    print("\n" + describe(rows, dtype, args.device))
    if args.memory_length:
        mem = cubit_memory(length=args.memory_length, device=args.device)
        print(
            f"\nforward+backward peak memory at T={args.memory_length} (B=1, H=8, d=64, float32): "
            + ", ".join(f"{key} {val:.0f} MiB" if val is not None else f"{key} n/a" for key, val in mem.items())
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([row.__dict__ for row in rows], fh, indent=2)
        print(f"\nwrote {args.json}")
    bad = [r.mixer for r in rows if max(r.forward_error, r.grad_error) >= ERROR_BOUNDS[dtype]]
    return 1 if bad else 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _mixer_list(text: str) -> list[str]:
    from .layers import MIXERS

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MIXERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown mixer(s) {', '.join(repr(n) for n in unknown) or repr(text)} (choose from: {', '.join(MIXERS)})"
        )
    return names


def _model_info(args: argparse.Namespace) -> int:
    import torch

    from .model import CausalLM, ModelConfig

    overrides = {"mixers": args.mixers} if args.mixers else {"mixer": args.mixer}
    try:
        config = ModelConfig.preset(args.preset, **overrides)
    except ValueError as err:  # e.g. a --mixers list of the wrong length
        args.parser.error(str(err))
    with torch.device("meta"):  # shapes only: instant and no memory, even for 1.3b
        model = CausalLM(config)
    total = model.num_parameters()
    embedding = model.embed.weight.numel()
    mixer = sum(p.numel() for block in model.blocks for p in block.mixer.parameters())
    mlp = sum(p.numel() for block in model.blocks for p in block.mlp.parameters())
    names = config.layer_mixers()
    layout = f"{names[0]} x {len(names)}" if len(set(names)) == 1 else ", ".join(names)
    print(f"preset {args.preset}: {config.num_layers} layers ({layout})")
    print(config.to_json())
    head = 0 if config.tie_embeddings else model.lm_head.weight.numel()
    tied = "tied with the LM head, counted once" if config.tie_embeddings else f"LM head separate: {head:,}"
    print(f"embedding: {embedding:,} ({tied})")
    print(f"mixers: {mixer:,}  MLPs: {mlp:,}  norms: {total - embedding - head - mixer - mlp:,}")
    print(f"parameters: {total:,} ({total / 1e6:.1f}M)")
    return 0


def _generate_bench(args: argparse.Namespace) -> int:
    import torch

    from .generate import benchmark_generation, format_bench_table

    try:
        device = torch.device(args.device)
    except RuntimeError:
        args.parser.error(f"unknown device {args.device!r} (e.g. cpu, cuda, cuda:1)")
    if device.type == "cuda" and not torch.cuda.is_available():
        args.parser.error("--device cuda asked for, but torch sees no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    where = f"{torch.get_num_threads()} CPU threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    uncached = args.new_tokens if args.uncached_new_tokens is None else args.uncached_new_tokens
    fewer = 0 < uncached < args.new_tokens
    print(
        f"kernelmix generate-bench: preset {args.preset}, freshly initialised float32 models, greedy, batch "
        f"{args.batch}, prompt {args.prompt_length} tokens; cached: {args.new_tokens} new tokens, uncached: "
        + (f"{uncached} new tokens" if uncached else "not measured")
        + f"; {where}, median of {args.repeats}\n"
    )
    try:
        rows = benchmark_generation(
            args.preset, args.mixers, prompt_length=args.prompt_length, new_tokens=args.new_tokens,
            uncached_new_tokens=uncached, batch=args.batch, repeats=args.repeats, seed=args.seed, device=device,
        )
    except ValueError as err:  # e.g. prompt + new tokens beyond the preset's max_seq_len
        args.parser.error(str(err))
    print(format_bench_table(rows))
    print(
        "\ntokens/s = batch x new tokens / wall time of one generate call (prefill included)."
        + (
            f" Uncached was measured on {uncached} new tokens only (it recomputes the whole sequence per token); "
            f"its cost per token grows with length, so over {args.new_tokens} tokens it would be slower still and "
            "the ratio larger."
            if fewer else ""
        )
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                [dict(row.__dict__, speedup=row.speedup, prompt_length=args.prompt_length, batch=args.batch,
                      device=where) for row in rows],
                fh, indent=2,
            )
        print(f"wrote {args.json}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from .training import CheckpointError, run_config, train

    try:
        config = run_config(args.config, args.set, out_dir=args.out, resume=args.resume)
    except ValueError as err:  # unknown key, bad value, unknown preset/mixer/option
        args.parser.error(str(err))
    try:
        result = train(config, resume=args.resume)
    except (CheckpointError, ValueError) as err:  # an existing run, a bad checkpoint, a corpus problem
        print(f"kernelmix train: error: {err}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        last = result.losses.get(result.final_step)
        val = result.val_losses.get(result.final_step)
        print(
            f"step {result.final_step}/{result.total_steps}"
            + (f", loss {last:.4f}" if last is not None else "")
            + (f", val loss {val:.4f}" if val is not None else "")
            + f", {result.tokens_per_s:,.0f} tokens/s; metrics {result.metrics_path}, checkpoint {result.checkpoint}"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kernelmix", description="Kernel-regression token mixers for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run every mixer on a random batch: time and error against its reference")
    demo.add_argument("--batch", type=_positive_int, default=2)
    demo.add_argument("--length", type=_positive_int, default=512)
    demo.add_argument("--heads", type=_positive_int, default=4)
    demo.add_argument("--head-dim", type=_positive_int, default=32)
    demo.add_argument("--num-features", type=_positive_int, default=64)
    demo.add_argument("--repeats", type=_positive_int, default=3)
    demo.add_argument(
        "--memory-length", type=int, default=2048,
        help="also measure Cubit's peak memory (blocked vs dense) at this T; 0 to skip",
    )
    demo.add_argument("--json", help="also write the table as JSON to this path")
    demo.add_argument("--device", default="cpu", help="torch device for the fast paths, e.g. cuda (default: cpu)")
    demo.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="dtype of the fast paths")
    demo.set_defaults(func=_demo)

    from .layers import MIXERS
    from .model import PRESETS

    info = sub.add_parser("model-info", help="print a preset's config and parameter count")
    info.add_argument("preset", metavar="PRESET", choices=list(PRESETS), help=f"one of: {', '.join(PRESETS)}")
    which = info.add_mutually_exclusive_group()
    which.add_argument("--mixer", choices=list(MIXERS), default="softmax", help="the mixer of every layer")
    which.add_argument("--mixers", type=_mixer_list, help="one mixer per layer, comma-separated (a hybrid)")
    info.set_defaults(func=_model_info, parser=info)

    bench = sub.add_parser(
        "generate-bench", help="generation throughput per mixer: cached (prefill + 1 token/step) vs uncached"
    )
    bench.add_argument("--preset", choices=list(PRESETS), default="small")
    bench.add_argument("--mixers", type=_mixer_list, default=list(MIXERS), help="comma-separated (default: all)")
    bench.add_argument("--prompt-length", type=_positive_int, default=32)
    bench.add_argument("--new-tokens", type=_positive_int, default=1024)
    bench.add_argument(
        "--uncached-new-tokens", type=_non_negative_int, default=None,
        help="measure the slow uncached baseline on this many new tokens (default: --new-tokens; 0 skips it)",
    )
    bench.add_argument("--batch", type=_positive_int, default=1)
    bench.add_argument("--repeats", type=_positive_int, default=1)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's)")
    bench.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    bench.add_argument("--json", help="also write the rows as JSON to this path")
    bench.set_defaults(func=_generate_bench, parser=bench)

    trainer = sub.add_parser(
        "train", help="train a model on text (a preset + overrides); checkpoints, metrics, exact --resume",
        description="Train a CausalLM: settings from --config (TOML/YAML/JSON) and --set key=value "
        "(e.g. --set model.mixer=cubit --set lr=3e-4 --set model.mixer_options.cubit.lrr=false). "
        "Many processes: torchrun --nproc_per_node=N -m kernelmix.cli train ...",
    )
    trainer.add_argument("--config", help="a .toml, .yaml or .json file of settings (or a run's config.json)")
    trainer.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one setting (repeatable)")
    trainer.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    trainer.add_argument("--out", help="the run directory (sets out_dir)")
    trainer.set_defaults(func=_train, parser=trainer)

    opbench = sub.add_parser(
        "bench", help="op speed and memory per mixer vs T (forward, forward+backward, decode); JSON + PNG",
    )
    opbench.add_argument("--mixers", type=_mixer_list, default=None, help="comma-separated (default: all)")
    opbench.add_argument("--lengths", type=_int_list, default=[256, 512, 1024, 2048, 4096], help="e.g. 256,1024,4096")
    opbench.add_argument("--decode-positions", type=_int_list, default=[256, 1024, 4096])
    opbench.add_argument("--batch", type=_positive_int, default=1)
    opbench.add_argument("--heads", type=_positive_int, default=8)
    opbench.add_argument("--head-dim", type=_positive_int, default=64)
    opbench.add_argument("--num-features", type=_positive_int, default=128)
    opbench.add_argument("--chunk-size", type=_positive_int, default=64)
    opbench.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the inputs' dtype")
    opbench.add_argument(
        "--autocast", choices=["bfloat16", "float16"], default=None,
        help="run the forward passes under torch.autocast in this dtype (fp32 inputs; needs --dtype float32)",
    )
    opbench.add_argument("--device", default="cpu")
    opbench.add_argument("--repeats", type=_positive_int, default=3)
    opbench.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    opbench.add_argument("--out", default="benchmarks", help="directory for bench.json / bench.png")
    opbench.add_argument(
        "--peers", default="", help="comma-separated peers measured in the same run: performer-pytorch, "
        "fla-deltaformer-naive, cubit-dense (skipped with a note when not installed)",
    )
    opbench.add_argument("--peer-max-length", type=_positive_int, default=2048, help="largest T for the peers")
    opbench.set_defaults(func=_op_bench)

    # pretrained models, conversion and kernel diagnostics (their modules hold the commands)
    from . import compare as _compare, convert as _convert, diagnose as _diagnose, evaluate as _evaluate, pretrained as _pretrained
    from . import finetune as _finetune, report as _report

    for module in (_pretrained, _convert, _diagnose, _finetune, _report, _evaluate, _compare):
        module.add_commands(sub)
    return parser


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _op_bench(args: argparse.Namespace) -> int:
    from .bench import MIXER_NAMES, format_report, run_bench, write_report

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
