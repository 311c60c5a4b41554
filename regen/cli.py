"""The `regen` command line: profile a workload, solve a plan under a memory cap, show either file,
check a plan against the unplanned step, and run the end-to-end demo.

    regen profile --model mypkg.train:build --batch-size 8 -o run.profile.yaml
    regen solve run.profile.yaml --memory-cap 60% -o run.plan.yaml
    regen show run.plan.yaml
    regen check --model mypkg.train:build --batch-size 8 --plan run.plan.yaml

Errors caused by input (see regen.errors) print one line, `error: ...`, and exit non-zero; the
stages are imported lazily so `regen --help` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from pathlib import Path

from regen.version import __version__
from regen.errors import RegenError
from regen.units import format_bytes

DEFAULT_REPEATS = 3
DEFAULT_WARMUP_STEPS = 1
DEFAULT_WARMUP_S = 2.0  # a small model's CPU step keeps getting faster for ten steps or so
DEFAULT_TIME_LIMIT_S = 60.0
# the library's errors name solve's parameters (regen.planner.options.SolveOptions); the CLI says its flags
SOLVE_FLAGS = {"time_limit_s": "--time-limit", "link_ratio": "--link-ratio", "bandwidth_gb_s": "--bandwidth",
               "host_memory_cap_bytes": "--host-memory-cap"}
STRATEGY_ARGUMENT = re.compile(r"\bstrategy='([\w-]+)'")  # strategy='hybrid' -> --strategy hybrid


def in_flag_terms(message: str) -> str:
    """A library message with solve's parameter names as `regen solve`'s flags."""
    for name, flag in SOLVE_FLAGS.items():
        message = re.sub(rf"\b{name}\b", flag, message)
    return STRATEGY_ARGUMENT.sub(r"--strategy \1", message)


def _print_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _native_output_silenced():
    """File descriptors 1 and 2 to /dev/null: what C++ libraries print (HiGHS's banner) is dropped under
    -q. Errors are raised as exceptions and printed after this has restored both."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved + [devnull]:
            os.close(fd)


def _progress(quiet: bool):
    """Where a command's messages go: stderr, or nowhere with -q (errors are printed either way)."""
    return (lambda _message: None) if quiet else _print_progress


# ---- profile -----------------------------------------------------------------------------------


def cmd_profile(args: argparse.Namespace) -> int:
    from regen.formats import save_profile
    from regen.formats.yamlio import check_output_path
    from regen.profiler import profile_workload
    from regen.runtime.self_timing import measure_runtime_costs
    from regen.workloads import workload_source

    spec, wargs, batch_size, autocast = _workload_options(args)
    sources = tuple(p for p in (args.config, workload_source(spec)) if p)
    check_output_path(args.output, inputs=sources)  # before the long work; never over the workload's own files
    say = _progress(args.quiet)
    device, build = _workload_builder(args, spec, wargs, batch_size, autocast, say)
    workload = build()
    profile = profile_workload(workload, device=device, repeats=args.repeats, warmup_steps=args.warmup,
                               warmup_s=args.warmup_s,
                               progress=None if args.quiet else _print_progress, runtime_probe=measure_runtime_costs,
                               park=args.park)
    if not _is_rank_0():  # profiled on every rank of a process group (FSDP's collectives); rank 0 writes it
        return 0
    _calibrate(args, workload, profile, say)
    save_profile(profile, args.output)
    say(f"wrote {args.output}: {len(profile.ops)} ops, {len(profile.saved_tensors)} saved tensors, "
        f"unplanned peak {format_bytes(profile.peak_bytes)}")
    return 0


def _calibrate(args: argparse.Namespace, workload, profile, say) -> None:
    """The profile's calibration (regen.calibration), unless asked not to or the step cannot run unplanned."""
    import torch.distributed as dist

    from regen.calibration import calibrate

    if args.no_calibrate:
        return
    if args.park or any("park" in note for note in profile.notes):
        say("calibration: skipped (the unplanned step does not fit on the device)")
        return
    if dist.is_available() and dist.is_initialized():
        say("calibration: skipped (a process group: the ranks would time plans one by one)")
        return
    with _native_output_silenced() if args.quiet else contextlib.nullcontext():  # HiGHS's banner
        profile.calibration = calibrate(workload, profile, say)


def _is_rank_0() -> bool:
    import torch.distributed as dist

    return not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0


def _workload_options(args: argparse.Namespace) -> tuple[str, dict, int | None, str | None]:
    """The workload spec, its keyword arguments, the batch size and the autocast dtype from
    --model/--config/--arg/--batch-size/--autocast."""
    from regen.workloads import load_config

    spec, wargs, batch_size, autocast = args.model, {}, args.batch_size, args.autocast
    if args.config:
        config = load_config(args.config)
        spec = spec or config["workload"]
        wargs = config["args"]
        batch_size = batch_size if batch_size is not None else config["batch_size"]
        autocast = autocast if autocast is not None else config.get("autocast")
    if not spec:
        raise RegenError("give a workload: --model NAME|module:function, or --config configs/X.yaml")
    for item in args.arg or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise RegenError(f"--arg expects KEY=VALUE, got '{item}'")
        import yaml

        wargs[key] = yaml.safe_load(value)
    return spec, wargs, batch_size, autocast


def _workload_builder(args: argparse.Namespace, spec: str, wargs: dict, batch_size: int | None,
                      autocast: str | None, say):
    """A function building the workload on --device (checked now, before anything is built)."""
    from regen.profiler.environment import resolve_device
    from regen.workloads import build_workload

    device = str(resolve_device(args.device))

    def build():
        say(f"building workload {spec} (batch size {batch_size if batch_size is not None else 'default'})")
        return build_workload(spec, batch_size=batch_size, args=wargs, device=device, autocast=autocast)

    return device, build


# ---- check -------------------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    from regen.check import check_plan, report_lines
    from regen.formats import load_plan

    plan = load_plan(args.plan)
    spec, wargs, batch_size, autocast = _workload_options(args)
    say = _progress(args.quiet)
    _, build = _workload_builder(args, spec, wargs, batch_size, autocast, say)
    report = check_plan(build, plan, timed_steps=args.steps, progress=say)
    print(f"regen check: plan {args.plan} ({plan.strategy}) on {spec}")
    print("\n".join(report_lines(report)))
    if report.passed:
        return 0
    return 1 if report.conclusive else 3


# ---- solve -------------------------------------------------------------------------------------



def cmd_solve(args: argparse.Namespace) -> int:
    from regen.formats import save_plan
    from regen.formats.profile import OTHER_HOOKS_ADVICE
    from regen.formats.yamlio import check_output_path
    from regen.planner import SolveOptions, solve
    from regen.planner.held_gradients import held_gradient_bytes
    from regen.planner.host_link import machine_ram_bytes
    from regen.units import format_duration, parse_memory_cap

    check_output_path(args.output, inputs=(args.input,))
    host_cap_bytes = None
    if args.host_memory_cap is not None:
        host_cap_bytes = parse_memory_cap(args.host_memory_cap, machine_ram_bytes() or 0, flag="--host-memory-cap",
                                          percent_of="this machine's RAM")
    say = _progress(args.quiet)
    profile = _load_solver_input(Path(args.input), args.bandwidth)
    held_bytes = held_gradient_bytes(profile) if args.gradients_held else 0
    cap_bytes = parse_memory_cap(args.memory_cap, profile.peak_bytes + held_bytes)
    for note in profile.notes:
        if note.endswith(OTHER_HOOKS_ADVICE):
            say(f"warning: {note}")
    with _native_output_silenced() if args.quiet else contextlib.nullcontext():  # HiGHS's banner
        options = SolveOptions(strategy=args.strategy, time_limit_s=args.time_limit, bandwidth_gb_s=args.bandwidth,
                               link_ratio=args.link_ratio, host_memory_cap_bytes=host_cap_bytes,
                               profile_path=str(args.input), gradients_held=args.gradients_held)
        plan = solve(profile, cap_bytes, options, progress=None if args.quiet else _print_progress)
    save_plan(plan, args.output)
    counts = plan.action_counts()
    time_unit = plan.workload.get("time_unit")
    say(
        f"wrote {args.output}: keep {counts['keep']}, swap {counts['swap']}, recompute {counts['recompute']}; "
        f"peak {format_bytes(plan.simulated.peak_bytes)} under cap {format_bytes(plan.memory_cap_bytes)} "
        f"(unplanned {format_bytes(plan.baseline.peak_bytes)}); step time "
        f"{format_duration(plan.simulated.step_time_s, time_unit)} vs "
        f"{format_duration(plan.baseline.step_time_s, time_unit)} unplanned")
    return 0


def _load_solver_input(path: Path, bandwidth_gb_s: float | None):
    """What `regen solve` reads: a profile file, or a training graph in node-link JSON (its copies at
    `bandwidth_gb_s`, which the planner checks)."""
    from regen.errors import FormatError
    from regen.formats import load_profile
    from regen.graphs import is_node_link_file, load_node_link

    if not path.exists():
        raise FormatError(f"{path}: no such file")
    if is_node_link_file(path):
        return load_node_link(path, bandwidth_gb_s)
    return load_profile(path)


# ---- show --------------------------------------------------------------------------------------


def cmd_show(args: argparse.Namespace) -> int:
    from regen.formats import Plan, load_profile_or_plan
    from regen.show import plan_summary, plan_summary_json, plot_timeline, profile_summary, profile_summary_json

    from regen.formats.yamlio import check_output_path

    if args.plot:
        check_output_path(args.plot, inputs=(args.file,), what="--plot")
    document = load_profile_or_plan(Path(args.file))
    if not isinstance(document, Plan):
        if args.plot:
            raise RegenError("--plot draws a plan's timelines; give it a plan file")
        print(json.dumps(profile_summary_json(document)) if args.json else profile_summary(document))
        return 0
    if args.plot:
        plot_timeline(document, args.plot)
        _print_progress(f"wrote {args.plot}")
    print(json.dumps(plan_summary_json(document)) if args.json else plan_summary(document))
    return 0


# ---- demo --------------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from regen.demo import run_demo

    return run_demo(output_dir=Path(args.output_dir), config=args.config, progress=_print_progress)


# ---- helpers -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="regen",
        description="Train PyTorch models under a memory cap: profile one step, solve a MILP that keeps, "
                    "swaps or recomputes every saved activation, and replay the plan in your training loop.",
        epilog="Typical use:\n"
               "  regen profile --model mypkg.train:build --batch-size 8 -o run.profile.yaml\n"
               "  regen solve run.profile.yaml --memory-cap 60% -o run.plan.yaml\n"
               "  # train.py: with regen.apply(model, regen.load_plan('run.plan.yaml')): ...\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"regen {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_profile_command, _add_solve_command, _add_show_command, _add_check_command, _add_demo_command):
        add(sub)
    return parser


def _add_profile_command(sub) -> None:
    p = sub.add_parser("profile", help="record one real training step of a workload",
                       description="Run warm-up steps, then record one forward+backward step op by op "
                                   "(times, saved tensors, memory timeline) and write a profile.")
    _add_workload_options(p)
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help=f"timed steps; step and op times are their medians (default {DEFAULT_REPEATS})")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP_STEPS,
                   help=f"unrecorded warm-up steps, at least (default {DEFAULT_WARMUP_STEPS})")
    p.add_argument("--warmup-s", type=float, default=DEFAULT_WARMUP_S,
                   help=f"more warm-up steps while they and the timed plain steps after them take less than this "
                        f"many seconds, so step times have settled before they are measured (default "
                        f"{DEFAULT_WARMUP_S:g}; 0: none)")
    p.add_argument("--park", action="store_true",
                   help="park saved tensors in host memory while profiling, for a step that does not fit on the "
                        "device (the profile is the same; on CUDA an out-of-memory warm-up step does this by itself)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="skip the calibration (a plan that keeps every tensor, per-block checkpointing, a recompute "
                        "and a swap plan timed against the unplanned step, so that plans charge what regen's hooks, "
                        "module replays, recomputes and swaps cost this workload: two short solves and 30-45 "
                        "steps, at most about a minute of them)")
    p.add_argument("-o", "--output", required=True, help="where to write the profile (YAML)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    p.set_defaults(func=cmd_profile)


def _add_solve_command(sub) -> None:
    s = sub.add_parser("solve", help="choose keep, swap or recompute for every saved tensor under a cap",
                       description="Solve the MILP over a profile (or a node-link JSON graph) and write a plan "
                                   "checked by the simulator.")
    s.add_argument("input", help="a profile (YAML) or a computation graph in networkx node-link JSON")
    s.add_argument("--memory-cap", required=True,
                   help="device memory cap: bytes with a unit (6GiB, 512MB) or a percentage of the unplanned peak (60%%)")
    s.add_argument("--strategy", default="hybrid",
                   choices=["hybrid", "recompute", "swap", "str", "keep-all", "chen", "checkpoint-blocks",
                            "offload-all"],
                   help="hybrid (default): MILP over keep/swap/recompute; recompute or swap only; str: STR's "
                        "formulation (small graphs); keep-all, chen (sqrt(n) checkpointing), checkpoint-blocks "
                        "(per-block checkpointing) and offload-all (swap every saved tensor of 1 MiB or more, as "
                        "torchtune's activation offloading) heuristics")
    s.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S,
                   help=f"solver time limit in seconds; the best plan found is kept (default {DEFAULT_TIME_LIMIT_S:g})")
    s.add_argument("--bandwidth", type=float, metavar="GB/s",
                   help="host<->device copy bandwidth in GB/s (overrides the profile's measurement)")
    s.add_argument("--link-ratio", type=float, metavar="R",
                   help="set both bandwidths so that copying every saved tensor one way takes R x the unplanned "
                        "step time (0.9: PCIe next to a fast GPU; 0.1: NVLink-C2C); not with --bandwidth. A CPU-device "
                        "profile without --link-ratio or --bandwidth is planned with recompute only")
    s.add_argument("--host-memory-cap", metavar="SIZE",
                   help="bound on the host pool (pinned on CUDA): bytes with a unit (16GiB) or a percentage of this "
                        "machine's RAM (default 50%%)")
    s.add_argument("--gradients-held", action="store_true",
                   help="the training loop keeps its gradients from one step to the next (gradient accumulation "
                        "over micro-batches, or zero_grad(set_to_none=False)): the plan counts them for the whole "
                        "step, and a percentage cap is of the unplanned peak with them")
    s.add_argument("-o", "--output", required=True, help="where to write the plan (YAML)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    s.set_defaults(func=cmd_solve)


def _add_show_command(sub) -> None:
    sh = sub.add_parser("show", help="summarise a profile or a plan",
                        description="Print a readable summary of a profile or plan file, or one JSON object.")
    sh.add_argument("file", help="a profile or plan file")
    sh.add_argument("--json", action="store_true", help="print one JSON object instead")
    sh.add_argument("--plot", metavar="PNG", help="(plans) draw unplanned and planned memory timelines against the cap")
    sh.set_defaults(func=cmd_show)


def _add_check_command(sub) -> None:
    c = sub.add_parser("check", help="run a plan against the unplanned step and compare results",
                       description="Build the workload, run one unplanned and one planned step on the same batch "
                                   "and RNG state, compare loss, gradients and module buffers bit for bit, and "
                                   "print measured against planned peak memory and step time. Exit 1 on any "
                                   "difference or a peak over the cap; 3 when the steps differ but the model does "
                                   "not reproduce its own unplanned results either (a third copy runs them again: "
                                   "it draws randomness the seeds do not fix), so the check cannot judge.")
    c.add_argument("--plan", required=True, help="the plan file to check")
    _add_workload_options(c)
    c.add_argument("--steps", type=int, default=3, help="timed steps of each, interleaved (default 3)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    c.set_defaults(func=cmd_check)


def _add_demo_command(sub) -> None:
    d = sub.add_parser("demo", help="profile, solve at 50%% and train a built-in GPT, printing what it saved",
                       description="The main job end to end on a built-in GPT: profile, solve at 50% of the "
                                   "unplanned peak, train with and without the plan, and compare.")
    d.add_argument("--output-dir", default="demo-output", help="where the profile, plan and plot go")
    d.add_argument("--config", default=None, help="workload config (default: the built-in demo GPT)")
    d.set_defaults(func=cmd_demo)


def _add_workload_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="built-in workload (mlp, cnn, gpt, hf-gpt2, hf-bert, hf-llama) or "
                                        "module:function returning (model, batch[, loss_fn])")
    parser.add_argument("--config", help="a workload config (configs/*.yaml): workload, args, batch_size, autocast")
    parser.add_argument("--batch-size", type=int, help="passed to the workload factory when it accepts one")
    parser.add_argument("--arg", action="append", metavar="KEY=VALUE",
                        help="extra keyword argument for the factory (repeatable), e.g. --arg n_layer=4")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument("--autocast", choices=["bf16", "fp16"],
                        help="run the forward and the loss under torch.autocast at this dtype (mixed precision)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except RegenError as exc:
        print(f"error: {in_flag_terms(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def reference_markdown() -> str:
    """docs/cli.md, generated from the parser itself so the reference cannot drift from the code:
    `python -c "from regen.cli import reference_markdown as r; print(r(), end='')" > docs/cli.md`."""
    import os

    os.environ["COLUMNS"] = "100"  # stable wrapping of argparse's help text
    parser = build_parser()
    parts = ["# CLI reference", "",
             "Generated from `regen --help` and each subcommand's `--help` (a test keeps it in sync).",
             "Errors caused by input print one line, `error: ...`, on stderr and exit non-zero: 2 for bad "
             "input (malformed file, unknown workload, missing device, plan mismatch), 3 for a cap no plan "
             "can meet (the message gives the smallest feasible cap), 4 for a solver stopped without a "
             "feasible plan (the message gives a cap where a plan exists).", "", "```",
             parser.format_help().rstrip(), "```", ""]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, subparser in sub.choices.items():
        parts += [f"## regen {name}", "", "```", subparser.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
