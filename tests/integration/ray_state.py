"""What the tests ask Ray about its live actors and placement groups, read from the GCS's tables through
the driver's connection. Ray's State API (``ray.util.state``) would need the dashboard, which the local
instance raytrainer starts runs without (driver/ray_runtime.py)."""

from __future__ import annotations

import ray


def alive_actors(classes: tuple[str, ...] | None = None, job: str | None = None) -> list[dict]:
    """The live actors (``ActorClassName``, ``ActorID``, ``Pid``, ``JobID``, ...), of ``classes`` and
    ``job`` (hex) when given."""
    table = ray._private.state.actors(actor_state_name="ALIVE").values()
    return [a for a in table
            if (classes is None or a["ActorClassName"] in classes) and (job is None or a["JobID"] == job)]


def live_placement_groups() -> set[str]:
    """The ids of the placement groups not removed (created, or pending)."""
    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}
