"""Several ``lowcomm train`` runs in one mpirun (one start-up for many reference runs): each
entry of the JSON list in argv[1] is ``{"out": DIR, "overrides": ["key=value", ...]}`` and is
trained exactly as ``lowcomm train --set ... --out DIR`` would, on a fresh duplicate of the
world communicator (its own ledger), then checked to have written its summary."""
import json
import sys
from pathlib import Path

from common import Checks

import lowcomm
from lowcomm.ledger import Ledger
from lowcomm.registry import load_config
from lowcomm.trainer import run

world = lowcomm.init()
ok = Checks(world.rank)
for entry in json.loads(Path(sys.argv[1]).read_text()):
    cfg = load_config(None, entry["overrides"])
    summary = run(cfg, entry["out"], world.dup(Ledger(), "world"), progress=False)
    if world.rank == 0:
        ok((Path(entry["out"]) / "summary.json").exists(), f"{entry['out']}: no summary")
    ok(summary is not None, f"{entry['out']}: no result")
ok.report()
