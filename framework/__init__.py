"""train-free-serve: a torch.compile-based, Hydra-configured speculative-decoding inference framework."""

from __future__ import annotations

from typing import Any, Iterable, Optional


class LLM:
    """Python API: ``LLM(["model=tiny_llama", "compile=eager"]).generate([{"prompt": "Hi"}])``.

    ``overrides`` use the command line's syntax and compose ``conf/`` exactly as ``train_free_serve.py`` does.
    """

    def __init__(self, overrides: Optional[list[str]] = None, config: Any = None) -> None:
        from framework.config import compose
        from framework.engine import Engine

        self.config = config if config is not None else compose(overrides or [])
        self.engine = Engine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, requests: Iterable[Any]) -> list:
        """One :class:`~framework.request.RequestOutput` per request, in order. A request is a dict with
        ``prompt`` (str) or ``messages`` (chat) and optional sampling fields, or a plain prompt string."""
        items = [{"prompt": r} if isinstance(r, str) else r for r in requests]
        return self.engine.generate(items)

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks (``parallel.tensor_parallel_size > 1``; also done at exit) and let
        the next engine built in this process start from clean compile state (framework/compile_state.py)."""
        self.engine.close()


__all__ = ["LLM"]
