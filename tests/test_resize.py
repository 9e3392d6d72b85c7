"""Resume on another number of ranks (issue 16, part 2): every method, 4 → 2 and 2 → 4, in one
4-rank mpirun (tests/workers/resize.py): the merged parameters equal the average of the old
ranks' parameters recomputed from the checkpoint files, and the resumed run finishes with a
finite eval loss and one model on every rank. The parameter server: see test_async_ps."""
import json

from conftest import run_worker

# name: [strategy spec, extra overrides, whether the ranks' parameters differ at the checkpoint
# (step 6: periods of 4 end at 4 and 8, so an outer loop's replicas have drifted)]
METHODS = {
    "syncdp-ef-sign": ["syncdp", ["compressor.name=ef-sign"], False],
    "onebit-adam": ["syncdp", ["optimizer.name=onebit-adam", "optimizer.freeze_step=2"], False],
    "localsgd": ["localsgd:period=4", [], True],
    "diloco": ["diloco:period=4,compressor=ef-sign", [], True],
    "streaming-diloco": ["streaming-diloco:period=4,fragments=2,delay=1", [], True],
    "gossip": ["gossip:graph=ring", [], True],
    "gossip-push-sum": ["gossip:graph=one-peer-exponential,gossip_mode=push-sum", [], True],
}


def test_every_method_resumes_on_half_and_on_twice_the_ranks(tmp_path):
    run_worker(4, "resize.py", str(tmp_path), json.dumps(METHODS), timeout=400)
