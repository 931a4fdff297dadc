"""vLLM from a weightserve server: a load format and a weight-transfer backend.

Installing weightserve with its ``vllm`` extra (``pip install -e '.[vllm]'`` in a checkout)
beside vLLM registers both through vLLM's ``vllm.general_plugins`` entry point, which every
vLLM process runs (the engine core loads the model in a process of its own, so a registration
by import in the caller would not reach it)::

    HF_ENDPOINT=http://weights:8080 vllm serve smollm2 --load-format weightserve
    LLM(model="smollm2", load_format="weightserve",
        weight_transfer_config={"backend": "weightserve"})   # + live updates

- ``--load-format weightserve`` (client/vllm/loader.py): the weights stream from the server
  into the engine's parameters; nothing is written to the worker's disk. The server, model,
  revision and token come from ``model_loader_extra_config`` (``url``, ``model``,
  ``revision``, ``token``) or from ``WEIGHTSERVE_URL`` / ``HF_ENDPOINT``, vLLM's model and
  ``--revision``, ``WEIGHTSERVE_TOKEN`` / ``HF_TOKEN``.
- the ``weightserve`` weight-transfer backend (client/vllm/transfer.py): an update names a
  revision; the engine takes the delta from the revision it holds and applies it, all or
  nothing. ``follow`` (client/vllm/follow.py) keeps an engine on ``main`` as it moves.
"""

from __future__ import annotations

__all__ = ["register"]

_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the load format and the backend
    (once per process; vLLM may call it several times)."""
    global _registered
    if _registered:
        return
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.model_loader import register_model_loader

    from weightserve.client.vllm.loader import LOAD_FORMAT, TRANSFER_BACKEND, make_loader_class

    register_model_loader(LOAD_FORMAT)(make_loader_class())
    if TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            TRANSFER_BACKEND, "weightserve.client.vllm.transfer", "WeightserveTransferEngine"
        )
    _registered = True
