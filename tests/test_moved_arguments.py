"""Keywords of the public API that moved into one options object (the run's objects into a
Context, the task's functions into a Task, how a run starts into RunOptions): the old spelling
fails at once with an ArgumentError naming the new one, before any rank communicates (one
process, in-process)."""
import pytest
import torch

import lowcomm
from lowcomm.errors import ArgumentError


def linear():
    m = torch.nn.Linear(3, 2)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


@pytest.mark.parametrize("make, old, new", [
    (lambda m, o, kw: lowcomm.DiLoCo(m, o, period=2, **kw), "bn_batches", "Context(batches="),
    (lambda m, o, kw: lowcomm.LocalSGD(m, o, **kw), "levels", "Context(levels="),
    (lambda m, o, kw: lowcomm.LocalSGD(m, o, **kw), "warmup_options", "Context(compressor="),
    (lambda m, o, kw: lowcomm.PipelineParallel(m, o, criterion=sum, **kw), "split_batch",
     "Context(split="),
    (lambda m, o, kw: lowcomm.PipelineParallel(m, o, criterion=sum, **kw), "example",
     "Context(batches=[example])"),
    (lambda m, o, kw: lowcomm.build("localsgd", m, o, **kw), "nonfinite", "Context(nonfinite="),
    (lambda m, o, kw: lowcomm.build("async-ps", m, o, **kw), "steps", "Context(steps="),
    (lambda m, o, kw: lowcomm.train(**kw), "model", "task=lowcomm.from_functions("),
    (lambda m, o, kw: lowcomm.train("lowcomm.tasks.bytelm", **kw), "resume", "RunOptions(resume="),
])
def test_an_old_keyword_is_an_error_naming_its_new_spelling(make, old, new):
    m, o = linear()
    with pytest.raises(ArgumentError) as e:
        make(m, o, {old: None})
    assert e.value.key == old and new in str(e.value), str(e.value)
    o.step()                                    # the failed build left the optimizer unguarded


def test_a_value_given_twice_is_an_error_naming_it():
    """(The new spellings at work: the MPI checks, e.g. check_batchnorm's context batches,
    check_optimizer's context NaN policy.)"""
    m, o = linear()
    with pytest.raises(ArgumentError, match="nonfinite.*unknown value 'later'"):
        lowcomm.build("localsgd", m, o, context=lowcomm.Context(nonfinite="later"))
    with pytest.raises(ArgumentError, match="out.*given twice"):
        lowcomm.train("lowcomm.tasks.bytelm", out="a", run=lowcomm.RunOptions(out="b"))
    with pytest.raises(ArgumentError, match="compressor.*given twice"):
        lowcomm.build("syncdp", m, o, compressor="int8",
                      context=lowcomm.Context(compressor=lowcomm.CompressorSettings(name="sign")))
