"""The legacy text-generation server (Megatron-Core's ``text_generation_server.text_generation_server``).

``PUT /api`` (:class:`MegatronGenerate`) takes ``{"prompts": [...], "tokens_to_generate", "logprobs",
"temperature", "top_k", "top_p", ...}`` and answers ``{"text", "segments", "logprobs", "tokens"}``
from :func:`~.run_mcore_engine.run_mcore_engine`; ``POST /completions`` is
:class:`~.endpoints.completions.MegatronCompletions`. Megatron-Core serves them with Flask; we use
FastAPI + uvicorn (the ``server`` extra, imported when a :class:`MegatronServer` is built). Field
checks and their messages are Megatron-Core's; every refusal answers 400 with the message as a
JSON string (Megatron-Core answers some of them with status 200). Rank 0 serves; before each
generation it wakes the other ranks with :func:`~.endpoints.common.send_do_generate`.
"""

# No ``from __future__ import annotations``: FastAPI must see the real ``Request`` class in the endpoint signatures.
import datetime
import json
import logging
from typing import Any

from megatron_core.inference.text_generation_server.endpoints.common import LOCK, send_do_generate
from megatron_core.inference.text_generation_server.endpoints.completions import MegatronCompletions
from megatron_core.inference.text_generation_server.run_mcore_engine import run_mcore_engine

__all__ = ["MegatronGenerate", "MegatronServer"]

logger = logging.getLogger(__name__)

MAX_PROMPTS = 128


class RequestRefused(ValueError):
    """A request field the server refuses; the message is what the client sees (status 400)."""


def _typed(body: dict, name: str, default: Any, valid: Any, message: str) -> Any:
    """``body[name]`` when ``valid(value)``, ``default`` when absent, else :class:`RequestRefused` (``message``)."""
    if name not in body:
        return default
    value = body[name]
    if not valid(value):
        raise RequestRefused(message)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_float(value: Any) -> bool:
    return isinstance(value, float)


class MegatronGenerate:
    """``PUT /api``: validate the request as Megatron-Core does, then generate on every rank."""

    def __init__(self, engine: Any, args: Any = None) -> None:
        self.engine = engine
        self.args = args
        self.verbose = getattr(args, "inference_flask_server_logging", False)

    @staticmethod
    def _prompts(body: dict) -> list[str]:
        for name, message in (("max_len", "max_len is no longer used.  Replace with tokens_to_generate"),
                              ("sentences", "sentences is no longer used.  Replace with prompts"),
                              ("beam_width", "Beam search is no longer supported.")):
            if name in body:
                raise RequestRefused(message)
        prompts = body["prompts"]
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise RequestRefused("prompts is not a list of strings")
        if not prompts:
            raise RequestRefused("prompts is empty")
        if len(prompts) > MAX_PROMPTS:
            raise RequestRefused(f"Maximum number of prompts is {MAX_PROMPTS}")
        return prompts

    @staticmethod
    def _settings(body: dict) -> dict[str, Any]:
        """The generation settings, checked in Megatron-Core's order and with its messages."""
        tokens = _typed(body, "tokens_to_generate", 64, _is_int, "tokens_to_generate must be an integer greater than 0")
        if tokens < 0:
            raise RequestRefused("tokens_to_generate must be an integer greater than or equal to 0")
        logprobs = _typed(body, "logprobs", False, _is_bool, "logprobs must be a boolean value")
        if tokens == 0 and not logprobs:
            raise RequestRefused("tokens_to_generate=0 implies logprobs should be True")
        message = "temperature must be a positive number less than or equal to 100.0"
        temperature = _typed(body, "temperature", 1.0,
                             lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 < v <= 100.0,
                             message)
        top_k = _typed(body, "top_k", 0, _is_int,
                       "top_k must be an integer equal to or greater than 0 and less than or equal to 1000")
        if not 0 <= top_k <= 1000:
            raise RequestRefused("top_k must be equal to or greater than 0 and less than or equal to 1000")
        top_p = _typed(body, "top_p", 0.0, _is_float, "top_p must be a positive float less than or equal to 1.0")
        if top_p > 0.0 and top_k > 0:
            raise RequestRefused("cannot set both top-k and top-p samplings.")
        if not 0 <= top_p <= 1.0:
            raise RequestRefused("top_p must be less than or equal to 1.0")
        decay = _typed(body, "top_p_decay", 0.0, _is_float,
                       "top_p_decay must be a positive float less than or equal to 1.0")
        if "top_p_decay" in body and top_p == 0.0:
            raise RequestRefused("top_p_decay cannot be set without top_p")
        if not 0 <= decay <= 1.0:
            raise RequestRefused("top_p_decay must be less than or equal to 1.0")
        bound = _typed(body, "top_p_bound", 0.0, _is_float,
                       "top_p_bound must be a positive float less than or equal to top_p")
        if "top_p_bound" in body:
            if top_p == 0.0:
                raise RequestRefused("top_p_bound cannot be set without top_p")
            if not 0.0 < bound <= top_p:
                raise RequestRefused("top_p_bound must be greater than 0 and less than top_p")
        add_bos = _typed(body, "add_BOS", False, _is_bool, "add_BOS must be a boolean value")
        for name in ("stop_on_double_eol", "stop_on_eol", "prevent_newline_after_colon"):
            _typed(body, name, False, _is_bool, f"{name} must be a boolean value")
        seed = _typed(body, "random_seed", -1, _is_int, "random_seed must be integer")
        if seed < 0 and "random_seed" in body:
            raise RequestRefused("random_seed must be a positive integer")
        _typed(body, "stop_token", 50256, _is_int, "stop_token must be an integer")
        _typed(body, "length_penalty", 1, _is_float, "length_penalty must be a float")
        return dict(tokens_to_generate=tokens, logprobs=logprobs, temperature=temperature, top_k=top_k,
                    top_p=top_p, add_BOS=add_bos, random_seed=seed)

    def put(self, body: Any) -> tuple[Any, int]:
        """Answer one request: ``(JSON payload, HTTP status)``."""
        if not isinstance(body, dict) or "prompts" not in body:
            return "prompts argument required", 400
        try:
            prompts = self._prompts(body)
            settings = self._settings(body)
            if any(not p for p in prompts) and not settings["add_BOS"]:
                raise RequestRefused("Empty prompts require add_BOS=true")
        except RequestRefused as refused:
            return str(refused), 400
        with LOCK:  # one generation at a time: the ranks must see the broadcasts in the same order
            if self.verbose:
                logger.info("request at %s: %s", datetime.datetime.now(), json.dumps(body))
            try:
                send_do_generate()
                response = run_mcore_engine(
                    self.engine, prompts, settings["temperature"], settings["top_k"], settings["top_p"],
                    settings["logprobs"], settings["tokens_to_generate"], random_seed=settings["random_seed"])
            except ValueError as error:
                return str(error), 400
        return response, 200


class MegatronServer:
    """The FastAPI app with ``PUT /api`` and ``POST /completions`` over ``model`` (an inference engine)."""

    def __init__(self, model: Any, args: Any = None) -> None:
        from megatron_core.inference.text_generation_server.deps import require_server_deps

        fastapi, _ = require_server_deps()
        from fastapi.concurrency import run_in_threadpool
        from fastapi.responses import JSONResponse

        self.app = fastapi.FastAPI(title="megatron_core text generation")
        generate, completions = MegatronGenerate(model, args), MegatronCompletions(model, args)

        def body_of(raw: bytes) -> Any:
            try:
                return json.loads(raw)
            except (ValueError, RecursionError) as error:
                raise RequestRefused(f"the request body is not valid JSON: {error}") from error

        def answer(handler: Any, raw: bytes) -> Any:
            try:
                payload, status = handler(body_of(raw))
            except RequestRefused as refused:
                payload, status = str(refused), 400
            return JSONResponse(payload, status)

        async def api(request: fastapi.Request) -> Any:
            raw = await request.body()
            return await run_in_threadpool(answer, generate.put, raw)

        async def openai_completions(request: fastapi.Request) -> Any:
            raw = await request.body()
            return await run_in_threadpool(answer, completions.post, raw)

        self.app.add_api_route("/api", api, methods=["PUT"])
        self.app.add_api_route("/completions", openai_completions, methods=["POST"])

    def run(self, url: str, port: int) -> None:
        """Serve on ``url:port`` until interrupted (uvicorn)."""
        from megatron_core.inference.text_generation_server.deps import require_server_deps

        _, uvicorn = require_server_deps()
        uvicorn.run(self.app, host=url, port=port, log_level="warning")
