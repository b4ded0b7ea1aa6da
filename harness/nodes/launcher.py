"""torchrun with a bounded exit barrier: ``python -m aftershock.harness.nodes.launcher
--exit-barrier=S
<torchrun's arguments>``, run inside a node.

An agent whose ranks finished waits in torchrun's exit barrier for every other agent of the
rendezvous, 300 s, with no flag to change it. When a node is lost for good and its ranks were
replaced by spares on another node (``hot_spare``, docs/nodes.md), its agent never comes, and
the job would end five minutes after its last step. This sets the barrier's timeout on the
agent torchrun makes (``LocalElasticAgent``'s own ``exit_barrier_timeout`` argument) and runs
torchrun's ``main`` unchanged otherwise. Its import is the node's, not the harness's: torch is
there.
"""

from __future__ import annotations

import sys
from typing import Any


def main(argv: list[str]) -> None:
    if not argv or not argv[0].startswith("--exit-barrier="):
        raise SystemExit(
            "usage: python -m aftershock.harness.nodes.launcher --exit-barrier=SECONDS "
            "<torchrun arguments>"
        )
    seconds = float(argv[0].split("=", 1)[1])
    from torch.distributed import run
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api

    class Agent(LocalElasticAgent):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["exit_barrier_timeout"] = seconds
            super().__init__(*args, **kwargs)

    api.LocalElasticAgent = Agent  # type: ignore[attr-defined]  # what launch_agent() makes
    run.main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
