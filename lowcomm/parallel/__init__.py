"""Splitting the model, not only the data: the model-parallel axes.

* :mod:`~lowcomm.parallel.chains` — a model as a chain of pieces (stem, blocks, head), the
  shape pipeline stages are cut from; chains for the built-in GPT, transformers' GPT-2 and
  Llama, ``nn.Sequential``, and the user's own;
* :mod:`~lowcomm.parallel.stages` — where the cuts go (every N blocks, named split points,
  balanced by parameter count) and the stage module a rank runs;
* :mod:`~lowcomm.parallel.deferred` — a model built on the meta device with its initialisation
  recorded, each rank materialising only its part with the values a whole build gives;
* :mod:`~lowcomm.parallel.pipeline` — pipeline parallelism (``pp``) as a lowcomm method, on
  torch's own engine (:mod:`torch.distributed.pipelining`: its stages and schedules);
* :mod:`~lowcomm.parallel.plans` — tensor-parallel plans (Megatron's column/row splits,
  sequence-parallel norms) as torch's parallel styles, built in for the same model families;
* :mod:`~lowcomm.parallel.tensor` — tensor and sequence parallelism (``tp``) as a lowcomm
  method, on torch's DTensor engine (:mod:`torch.distributed.tensor.parallel`);
* :mod:`~lowcomm.parallel.experts` — mixture-of-experts layers (top-k routing under a capacity,
  the load-balancing loss) and expert parallelism: the experts spread over the ranks, tokens
  moved by all-to-all;
* :mod:`~lowcomm.parallel.ep` — expert parallelism (``ep``) as a lowcomm method of a level;
* :mod:`~lowcomm.parallel.replicas`, :mod:`~lowcomm.parallel.merge` — what the split methods
  share: data parallelism around a split model, and each rank's part of the model's state
  (gathered whole, resumed on another split by name).
"""
