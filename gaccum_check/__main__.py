"""``python -m gaccum_check invariance -- python train.py ...``: check a training script by invariance.

Runs the script at GA k on each process count (``torchrun`` for more than one) and as its
full batch, compares the weights after every update and the logged losses, prints the report
(:func:`gaccum_check.invariance_runs.check_script_invariance`). Exit status, as the report's
headline says: 0 passed, 1 failed, 3 inconclusive (other rows than the full batch's, a run that
could not be made, not deterministic, ...); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys

EXIT_STATUS = {"passed": 0, "failed": 1, "inconclusive": 3}  # 2: bad arguments (argparse's own)
EXAMPLE = ("python -m gaccum_check invariance --grad-accum-steps 4 --micro-batch-size 2 --processes 1 2 -- "
           "python train.py --grad_accum_steps {grad_accum_steps} --micro_batch_size {micro_batch_size}")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m gaccum_check", description="Check gradient accumulation in real training code.",
        epilog=f"example: {EXAMPLE}")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "invariance", help="run a script at GA k on P processes and as its full batch, and compare",
        description="The script must take its accumulation steps and its per-process micro-batch size as arguments: "
                    "write {grad_accum_steps} and {micro_batch_size} where they go.", epilog=f"example: {EXAMPLE}")
    check.add_argument("--grad-accum-steps", type=int, default=4, help="GA of the checked runs (default 4)")
    check.add_argument("--micro-batch-size", type=int, default=2, help="rows per micro-batch and process (default 2)")
    check.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="process counts to check (default 1 2)")
    check.add_argument("--tol", type=float, default=1e-4, help="relative tolerance, at most 0.01 (default 1e-4)")
    check.add_argument("--loss-pattern", default=None,
                       help="regular expression with one group that finds a logged loss on a line of the script's "
                            "output, stdout and stderr (default: the first number after the word 'loss' on a line)")
    check.add_argument("--no-losses", action="store_true", help="compare the weights only")
    check.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take (default 600)")
    check.add_argument("script", nargs=argparse.REMAINDER, help="after --: how you run the script on one process")
    args = parser.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        check.error(f"give the command after --, e.g. {EXAMPLE}")
    args.script = script
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from .invariance import InvarianceCheckError
    from .invariance_runs import DEFAULT_LOSS_PATTERN, check_script_invariance

    pattern = None if args.no_losses else (args.loss_pattern or DEFAULT_LOSS_PATTERN)
    try:
        report = check_script_invariance(args.script, grad_accum_steps=args.grad_accum_steps,
                                         micro_batch_size=args.micro_batch_size, num_processes=tuple(args.processes),
                                         tol=args.tol, loss_pattern=pattern, timeout=args.timeout)
    except (TypeError, ValueError) as exc:
        print(f"python -m gaccum_check invariance: error: {exc}", file=sys.stderr)
        return 2
    except InvarianceCheckError as exc:
        print(f"python -m gaccum_check invariance: {exc}", file=sys.stderr)
        return EXIT_STATUS["inconclusive"]
    print(report)
    return EXIT_STATUS[report.verdict]


if __name__ == "__main__":
    sys.exit(main())
