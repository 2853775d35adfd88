"""The report's segments table: the stretches of a run's training, each on its own
allocation or restart (world size, hosts, optimizer steps, steps redone), and how a restart
inside a Slurm job came about (ddpflow.cluster.in_job.annotate). Pure: no file system.

    blocks = segments_blocks(loaded)   # [] where no run has more than one segment
"""

from __future__ import annotations

from ddpflow.report.tables import hosts_text

TITLE = "Segments: runs continued on another allocation or after a restart"
NOTE = (
    "Each segment trained the optimizer steps shown, from the checkpoint the previous one "
    "left, at its own world size; the steps are the same training at any size (the global "
    "batch and the data order are the recipe's). Steps redone: what the attempt before had "
    "trained past that checkpoint, trained again (0 after a time limit or preemption signal). "
    "Restart: a segment that the training job started again inside its own allocation "
    "(machine.restarts_in_job, machine.spare_nodes), after what, and the seconds from the "
    "failure to its first optimizer step."
)
HEADERS = [
    "Run",
    "Segment",
    "World size",
    "Hosts",
    "Optimizer steps",
    "Steps",
    "Attempt",
    "Steps redone",
]


def restart_text(seg: dict) -> str:
    """'in job 12 after node2 lost (DOWN in Slurm); 14.2 s to its first step' ('–': none)."""
    restart = seg.get("restart_in_job")
    if not restart:
        return "–"
    after = restart.get("after") or {}
    lost = after.get("lost") or {}
    cause = (
        "; ".join(f"{node} lost ({why})" for node, why in lost.items())
        if lost
        else f"a rank failure (exit code {after.get('rc', '?')})"
    )
    text = f"in job {restart['job']} after {cause}"
    if (seconds := after.get("seconds_to_next_step")) is not None:
        text += f"; {seconds:.1f} s to its first step"
    return text


def segments_table(loaded) -> tuple | None:
    """The segments of each run that has more than one; None where none has."""
    body, restarts = [], False
    for name, _, ev in loaded:
        segments = ev["train"].get("segments") or []
        if len(segments) < 2:
            continue
        for number, seg in enumerate(segments, start=1):
            shape = [str(seg["world_size"]), hosts_text(seg["hosts"])]
            span = f"{seg['start_step']}–{seg['end_step']}"
            steps = [str(seg["end_step"] - seg["start_step"]), str(seg["attempt"])]
            redone = "–" if seg.get("steps_redone") is None else str(seg["steps_redone"])
            restarts = restarts or bool(seg.get("restart_in_job"))
            body.append([name, str(number), *shape, span, *steps, redone, restart_text(seg)])
    if not body:
        return None
    if not restarts:  # the column only where a job restarted inside its allocation
        return ("table", HEADERS, [row[:-1] for row in body], None)
    return ("table", [*HEADERS, "Restart"], body, None)


def segments_blocks(loaded) -> list[tuple]:
    table = segments_table(loaded)
    return [] if table is None else [("h3", TITLE), table, ("p", NOTE)]
