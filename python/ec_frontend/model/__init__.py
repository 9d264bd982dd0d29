"""The model layer: the families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA, LLaVA-NeXT,
LLaVA-OneVision; :mod:`ec_frontend.model.registry`), the built-in tiny model, input
processing.

Entry points live in :mod:`ec_frontend.model.loader` (``load_model``,
``load_processor``, ``ensure_builtin_checkpoint``); the runner's contract is
:mod:`ec_frontend.model.interface`. Nothing is imported here, so importing the
package stays cheap.
"""
