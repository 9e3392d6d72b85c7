"""Resume on another number of ranks (issue 16, part 2): every method, 4 → 2 and 2 → 4, in one
4-rank mpirun (tests/workers/resize.py): the merged parameters equal the average of the old
ranks' parameters recomputed from the checkpoint files, and the resumed run finishes with a
finite eval loss and one model on every rank."""
import json

from conftest import run_worker

# name: [strategy spec, extra overrides, whether the ranks' parameters differ at the checkpoint
# (step 3: periods of 2 end at 2 and 4, so an outer loop's replicas have drifted; streaming
# DiLoCo's fragment 0, sent at step 3, is in flight)]
METHODS = {
    "syncdp-ef-sign": ["syncdp", ["compressor.name=ef-sign"], False],
    "onebit-adam": ["syncdp", ["optimizer.name=onebit-adam", "optimizer.freeze_step=2"], False],
    "localsgd": ["localsgd:period=2", [], True],
    "diloco": ["diloco:period=2,compressor=ef-sign", [], True],
    "streaming-diloco": ["streaming-diloco:period=2,fragments=2,delay=1", [], True],
    "gossip": ["gossip:graph=ring", [], True],
    # 1 server + 3 workers <-> 1 server + 1 worker (checkpoints every N steps need τ = 0)
    "async-ps": ["async-ps:servers=1,max_staleness=0", [], False],
}


def test_every_method_resumes_on_half_and_on_twice_the_ranks(tmp_path):
    run_worker(4, "resize.py", str(tmp_path), json.dumps(METHODS), timeout=400)
