"""What a failed launch tells the notebook: the rank that failed first, its traceback, and a hint.

A rank whose peer died fails too ("Connection closed by peer"); that error is never reported as
the cause. Used by :mod:`gaccum_launch.processes`; kept apart so the launcher reads as the launch.
"""

from __future__ import annotations

import re
import signal

# Errors a rank raises only because another rank died: never the root cause.
_LOST_PEER = re.compile(r"closed by peer|reset by peer|broken pipe|pair closure|got 0 bytes|remote process exited|"
                        r"communicator was aborted|remote worker", re.IGNORECASE)


def failure_message(payloads: dict, ended: dict, unfinished, world: int, timeout) -> str | None:
    """What to tell about failed ranks, root cause first (``ended``: exit codes of ranks that ended without a
    result); None when every rank returned."""
    failed = {r: p for r, p in payloads.items() if not p["ok"]}
    errors = {r: p for r, p in failed.items() if not p["interrupted"]}
    genuine = {r: p for r, p in errors.items() if not _LOST_PEER.search(p["error"])}
    if genuine:  # the first rank to fail; ranks failing together (one bug everywhere) report the lowest
        earliest = min(p["time"] for p in genuine.values())
        rank = min(r for r, p in genuine.items() if p["time"] - earliest < 2.0)
        head = error_text(rank, world, payloads[rank])
    elif unfinished:
        rank, finished = None, [r for r in range(world) if r not in unfinished]
        head = (f"the launch did not finish within {timeout:g} s: ranks {unfinished} of {world} had not returned"
                f"{f' (ranks {finished} had)' if finished else ''}, so all its processes were stopped. A rank waiting "
                "in a collective (gather, all-reduce, a synchronising backward) that another rank never reaches waits "
                "forever; if the run is merely slow, pass a larger timeout= to launch")
    elif ended:
        rank = min(ended)
        how = f"killed by {signal.Signals(-ended[rank]).name}" if ended[rank] < 0 else f"exit code {ended[rank]}"
        head = (f"rank {rank} of {world} ended without returning a result ({how}): killed from outside, by the "
                "out-of-memory killer, or by os._exit")
    elif errors or failed:
        rank = min(errors or failed, key=lambda r: payloads[r]["time"])
        head = error_text(rank, world, payloads[rank])
    elif len(payloads) < world:
        return f"ranks {sorted(set(range(world)) - set(payloads))} of {world} returned no result (stopped, or killed)"
    else:
        return None
    others = [f"  rank {r}: {payloads[r]['error'].splitlines()[0][:200] if r in failed else 'ended without a result'}"
              for r in range(world) if r != rank and (r in failed or r not in payloads and r not in (unfinished or ()))]
    return head + ("\n\nthe other ranks:\n" + "\n".join(others) if others else "")


def error_text(rank: int, world: int, payload: dict) -> str:
    text = f"rank {rank} of {world} failed with {payload['error']}\n\ntraceback of rank {rank}:\n{payload['traceback']}"
    if "was not reinitialized" in payload["error"]:
        text += ("\nhint: the launched function used an Accelerator (or PartialState) created outside it, in this "
                 "kernel; launching resets that state. Create the Accelerator inside the launched function.")
    if "Cannot re-initialize CUDA in forked subprocess" in payload["error"]:
        text += "\nhint: this kernel used CUDA before the launch; restart it and keep kernel-side work on the CPU."
    return text
