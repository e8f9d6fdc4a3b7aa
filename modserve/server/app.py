"""The FastAPI app: routes, API-key check, and every error in OpenAI's shape."""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import modserve
from modserve.engine.client import EngineClient
from modserve.engine.engine import LLMEngine
from modserve.generation_defaults import GenerationDefaults
from modserve.core.registry import PluginError
from modserve.server.chat_tokenizer import ChatTokenizer
from modserve.server.async_engine import DEAD_MESSAGE, AsyncEngine
from modserve.server.chat import chat_prompt, create_chat_completion
from modserve.server.completions import create_completion
from modserve.server.embeddings import add_embedding_routes, refuse_generate
from modserve.server.errors import APIError, from_validation_error, invalid
from modserve.server.grammar_bounds import GrammarBounds
from modserve.server.generate import add_generate_routes
from modserve.server.metrics import ServerMetrics, server_metrics
from modserve.server.vllm_metrics import VllmMetrics
from modserve.server.lora import add_lora_routes, load_lora_modules, lora_cards
from modserve.server.lora_resolve import lora_resolution
from modserve.server.model_names import served_names
from modserve.server.openapi import PROTECTED_PREFIXES, declare_errors
from modserve.server.replicas import ReplicaSet
from modserve.server.responses import add_response_routes
from modserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse)
from modserve.server.http_hygiene import HTTPHygieneMiddleware
from modserve.server.json_body import DuplicateKey, JSONRoute
from modserve.server.limits import BodyLimitMiddleware, default_max_body_bytes
from modserve.server.request_limits import RequestLimits
from modserve.server.serving import ServerState
from modserve.server.tokenizer_pool import TokenizerPool

logger = logging.getLogger("modserve.server")

# /health, /version and /metrics stay open: probes and scrapers don't carry keys.


def create_app(engine: LLMEngine | Sequence[LLMEngine] | EngineClient, api_key: str | None = None,
               generation_defaults: GenerationDefaults | None = None) -> FastAPI:
    """An app serving ``engine``, which starts and stops with the app's lifespan: an EngineClient
    (engine-core processes: engine_process.py, or a ReplicaSet of them), or LLMEngines to step
    in a thread of this process.

    Several engines (data parallelism: replicas of one config, :func:`replicas.build_engines`)
    are served as one, each request routed to one of them by ``data_parallel_routing``.
    ``generation_defaults``: the model's sampling defaults, if already read (else read here)."""
    if isinstance(engine, LLMEngine) or isinstance(engine, (list, tuple)):
        engines = [engine] if isinstance(engine, LLMEngine) else list(engine)
        async_engine: EngineClient = AsyncEngine(engines[0]) if len(engines) == 1 else ReplicaSet(engines)
    else:
        async_engine = engine
    config = async_engine.config
    max_model_len = async_engine.limits.max_model_len
    tokenizer_path = config.tokenizer or config.model
    template = config.chat_template_text()
    names, hidden_names = served_names(config)
    num_engines = len(async_engine) if isinstance(async_engine, ReplicaSet) else 1
    metrics = server_metrics(config.metrics_naming, names[0], max_model_len, num_engines)
    async_engine.observer = metrics  # before start()
    state = ServerState(
        engine=async_engine,
        tokenizer=ChatTokenizer(tokenizer_path, config.model, template),
        pool=TokenizerPool(tokenizer_path, config.model, chat_template=template),
        model_name=names[0],
        model_aliases=tuple(names[1:]),
        hidden_aliases=hidden_names,
        max_model_len=max_model_len,
        max_waiting_requests=config.max_waiting_requests,
        grammar_timeout=config.grammar_compile_timeout,
        limits=RequestLimits.of(config),
        grammar_bounds=GrammarBounds.from_config(config),
        max_response_bytes=config.max_response_bytes,
        allow_special_tokens_in_content=config.allow_special_tokens_in_content,
        generation_defaults=generation_defaults or GenerationDefaults.of(config),
        on_submit=metrics.request_started,
    )
    state.resolve_lora = lora_resolution(state, config)  # lora_resolvers: bad names and options fail here

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s (max_model_len=%d)", state.model_name, state.max_model_len)
        if isinstance(async_engine, ReplicaSet):
            logger.info("data parallel: %d engine replicas, %s routing", len(async_engine), async_engine.routing)
        try:
            await load_lora_modules(state)  # lora_modules: checked by the engine before any request
            yield
        finally:
            async_engine.stop()
            state.pool.close()
            logger.info("engine stopped")

    app = FastAPI(title="modserve", version=modserve.__version__, lifespan=lifespan)
    app.router.route_class = JSONRoute  # before the routes: each parses its body with it
    app.state.server = state
    app.state.metrics = metrics
    max_body = config.max_request_body_bytes or default_max_body_bytes(max_model_len)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body, timeout=config.request_read_timeout)
    if api_key:  # outside the body limit: a request without the key is refused before its body is read
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(HTTPHygieneMiddleware)  # outermost: an ambiguous request is read no further
    _add_error_handlers(app)
    _add_routes(app, state, metrics)
    add_embedding_routes(app, state, async_engine)  # /v1/embeddings: a 400 unless the runner is pooling
    add_generate_routes(app, state)  # vLLM's token-in/token-out /inference/v1/generate, and /load
    add_response_routes(app, state, config.max_stored_responses)  # /v1/responses
    add_lora_routes(app, state)  # /v1/load_lora_adapter, /v1/unload_lora_adapter where allowed
    declare_errors(app)
    return app


def _add_routes(app: FastAPI, state: ServerState, metrics: ServerMetrics | VllmMetrics) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        refuse_generate(app, "/v1/completions")
        return await create_completion(body, state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        refuse_generate(app, "/v1/chat/completions")
        return await create_chat_completion(body, state, request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[_model_card(state, name) for name in (state.model_name, *state.model_aliases)]
                         + lora_cards(state))

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        if state.check_model(model) is not None:
            return next(card for card in lora_cards(state) if card.id == model)
        return _model_card(state, state.model_name if model in state.hidden_aliases else model)

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.alive:
            raise APIError(503, DEAD_MESSAGE if state.engine.dead_reason is not None else "the engine is not running",
                           type="server_error", code="engine_dead")
        if state.draining:
            raise APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": modserve.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(await state.engine.stats()), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise invalid("prompt", "give exactly one of prompt or messages")
        if body.messages is not None:
            tokens = await chat_prompt(state, body.messages, body.add_generation_prompt)
        else:
            tokens = await state.encode(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=tokens)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(body.model)
        vocab = state.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise invalid("tokens", f"token ids must be in [0, {vocab})")
        text = await state.pool.run(lambda tok: tok.decode(body.tokens))
        return DetokenizeResponse(prompt=text)


def _model_card(state: ServerState, name: str) -> ModelCard:
    # root is the served name, as vLLM reports it: the local path is nobody's business.
    return ModelCard(id=name, root=state.model_name, max_model_len=state.max_model_len)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        if isinstance(exc.__cause__, DuplicateKey):  # FastAPI raises it from the JSON error
            key = exc.__cause__.key
            return APIError(400, f"malformed JSON body: the key {key!r} appears twice in one object; give each "
                            "key once", param=key, code="invalid_json").response()
        return from_validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return APIError(exc.status_code, message).response()

    @app.exception_handler(PluginError)
    async def plugin_error(request: Request, exc: PluginError) -> Response:
        # A plugin broke its contract outside the engine's step (a grammar backend's compile):
        # its message names the plugin, which is what the operator must act on.
        logger.error("plugin error in %s %s: %s", request.method, request.url.path, exc, exc_info=exc)
        return APIError(500, str(exc), type="server_error", code="plugin_error").response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        # The server's own bug: what went wrong is in its log, not in the answer.
        return APIError(500, "internal server error (logged on the server)", type="server_error").response()


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` on the protected routes, else 401.

    A plain ASGI middleware (not BaseHTTPMiddleware): it never wraps the response,
    so streaming and client-disconnect detection pass through untouched.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES) and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
