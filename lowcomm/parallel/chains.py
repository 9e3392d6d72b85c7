"""A model as a chain of pieces — stem, blocks, head — which pipeline stages are cut from.

A transformer runs as ``embed(inputs) → block_1 → … → block_L → head``; GPipe (Huang et al.
2019, arXiv 1811.06965) and Megatron-LM's pipeline (Narayanan et al. 2021, arXiv 2104.04473)
cut it between blocks. A :class:`Chain` tells lowcomm how one model family runs that way, using
the model's own modules (nothing is traced or copied): the names of the modules the stem and
the head use, the name of the blocks' ``nn.ModuleList``, and three functions. A module the head
uses that is also the stem's (a tied input/output embedding) is *tied*: the first and the last
stage both hold it and their gradients are summed after each backward pass (Megatron's
embedding group), so both copies take the same update.

Built in: the byte-level GPT (:class:`~lowcomm.tasks.tinygpt.TinyGPT`), transformers'
``GPT2LMHeadModel`` and ``LlamaForCausalLM`` (built from a config), and ``nn.Sequential``
(every child a block). A user's own model passes its own chain, e.g.::

    class MyChain(Chain):
        stem, blocks, head = ("embed",), "layers", ("norm", "out")
        def embed(self, model, x): return model.embed(x)
        def out(self, model, x): return model.out(model.norm(x))

    PipelineParallel(model, opt, chain=MyChain(), microbatches=8)
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import ArgumentError


class Chain:
    """How one model family runs as stem → blocks → head (see the module docstring).

    ``stem``/``head``: names (``model.get_submodule``) of the modules run before / after the
    blocks; ``blocks``: the name of the ``nn.ModuleList`` of blocks. The functions run on the
    model's own modules: :meth:`embed` the stem on the first stage's inputs, :meth:`block` one
    block, :meth:`out` the head (its output goes to the task's ``criterion``)."""

    stem: tuple[str, ...] = ()
    blocks: str = ""
    head: tuple[str, ...] = ()

    def embed(self, model: nn.Module, *inputs) -> torch.Tensor:
        raise NotImplementedError

    def block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One block on the hidden states (default: ``block(x)``)."""
        return block(x)

    def out(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tied(self) -> tuple[str, ...]:
        """The modules both the stem and the head use (a tied embedding)."""
        return tuple(n for n in self.head if n in self.stem)


class TinyGPTChain(Chain):
    """lowcomm's byte-level GPT: token + position embedding, blocks, LayerNorm and the tied
    output projection."""

    stem, blocks, head = ("tok", "pos"), "blocks", ("ln", "tok")

    def embed(self, model, idx):
        return model.tok(idx) + model.pos(torch.arange(idx.shape[1], device=idx.device))

    def out(self, model, x):
        return model.ln(x) @ model.tok.weight.T


class CausalLMChain(Chain):
    """transformers' causal LMs: the stem, the blocks, a final ``norm`` and ``lm_head`` — or,
    where the config ties it to the input ``embedding`` (the same tensor), that embedding."""

    norm = embedding = ""

    def __init__(self, model: nn.Module, stem: tuple[str, ...]):
        self.stem = stem
        tied = model.lm_head.weight is model.get_submodule(self.embedding).weight
        self.head = (self.norm, self.embedding if tied else "lm_head")

    def out(self, model, x):
        x = model.get_submodule(self.norm)(x)
        if self.head[1] == self.embedding:
            return x @ model.get_submodule(self.embedding).weight.T
        return model.lm_head(x)


class GPT2Chain(CausalLMChain):
    """transformers' ``GPT2LMHeadModel``: ``wte`` + ``wpe`` (and dropout), the ``h`` blocks,
    ``ln_f`` and ``lm_head`` (tied to ``wte`` unless the config unties them). Blocks run with
    no attention mask: causal attention, as the whole model runs on unpadded input."""

    blocks, norm, embedding = "transformer.h", "transformer.ln_f", "transformer.wte"

    def __init__(self, model: nn.Module):
        super().__init__(model, ("transformer.wte", "transformer.wpe", "transformer.drop"))

    def embed(self, model, input_ids):
        t = model.transformer
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        return t.drop(t.wte(input_ids) + t.wpe(pos)[None])

    def block(self, block, x):
        y = block(x)
        return y[0] if isinstance(y, tuple) else y


class LlamaChain(CausalLMChain):
    """transformers' ``LlamaForCausalLM`` (and models of its shape: Mistral, Qwen2): the token
    embedding, the decoder layers with the rotary position embedding each stage computes
    itself (a buffer, no parameters), the final norm and ``lm_head`` (tied where the config
    ties it)."""

    blocks, norm, embedding = "model.layers", "model.norm", "model.embed_tokens"

    def __init__(self, model: nn.Module):
        super().__init__(model, ("model.embed_tokens",))
        self._rotary = model.model.rotary_emb

    def embed(self, model, input_ids):
        return model.model.embed_tokens(input_ids)

    def block(self, block, x):
        pos = torch.arange(x.shape[1], device=x.device)[None]
        y = block(x, position_embeddings=self._rotary(x, pos), position_ids=pos)
        return y[0] if isinstance(y, tuple) else y


class SequentialChain(Chain):
    """``nn.Sequential``: every child is a block; no stem, no head."""

    blocks = ""

    def embed(self, model, x):
        return x

    def out(self, model, x):
        return x


def chain_for(model: nn.Module, chain: Chain | None = None) -> Chain:
    """``chain`` (checked against ``model``), or the built-in chain of ``model``'s family; an
    :class:`~lowcomm.errors.ArgumentError` naming ``chain`` where there is none."""
    if chain is None:
        kind = type(model).__name__
        if isinstance(model, nn.Sequential):
            chain = SequentialChain()
        elif kind == "TinyGPT":
            chain = TinyGPTChain()
        elif kind == "GPT2LMHeadModel":
            chain = GPT2Chain(model)
        elif kind in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
            chain = LlamaChain(model)
        else:
            raise ArgumentError("chain", f"lowcomm knows no chain for a {kind}: pass chain= (a "
                                "lowcomm.parallel.chains.Chain naming the stem's, the blocks' and "
                                "the head's modules), or give the model as an nn.Sequential")
    if not isinstance(chain, Chain):
        raise ArgumentError("chain", f"must be a lowcomm.parallel.chains.Chain, got "
                            f"{type(chain).__name__}")
    check_chain(model, chain)
    return chain


def blocks_of(model: nn.Module, chain: Chain) -> nn.ModuleList | nn.Sequential:
    """The chain's blocks in ``model``."""
    return model if not chain.blocks else model.get_submodule(chain.blocks)


def check_chain(model: nn.Module, chain: Chain) -> None:
    """Every module the chain names exists, the blocks are a list, and every parameter of the
    model belongs to the stem, a block or the head (else it would train on no stage)."""
    for name in (*chain.stem, *chain.head, *([chain.blocks] if chain.blocks else [])):
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ArgumentError("chain", f"{type(chain).__name__} names module {name!r}, which "
                                f"the {type(model).__name__} does not have") from None
    blocks = blocks_of(model, chain)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) == 0:
        raise ArgumentError("chain", f"{chain.blocks or 'the model'} must be a non-empty "
                            "nn.ModuleList or nn.Sequential of blocks")
    owned = {id(p) for name in (*chain.stem, *chain.head)
             for p in model.get_submodule(name).parameters()}
    owned |= {id(p) for p in blocks.parameters()}
    stray = [n for n, p in model.named_parameters() if id(p) not in owned]
    if stray:
        raise ArgumentError("chain", f"parameters {stray[:4]} belong to neither the stem "
                            f"{list(chain.stem)}, the blocks ({chain.blocks or 'the model'}) nor "
                            f"the head {list(chain.head)} of {type(chain).__name__}: no stage "
                            "would train them; name their modules in the chain")


__all__ = ["CausalLMChain", "Chain", "GPT2Chain", "LlamaChain", "SequentialChain", "TinyGPTChain", "blocks_of",
           "chain_for", "check_chain"]
