"""One interface for driving vLLM in-process or over HTTP, and a crash-tolerant multi-step driver.

What it does: ``Runner`` is the protocol both drivers meet: ``generate(prompts, *, max_tokens,
logprobs=2)`` returns one ``RequestRecord`` per prompt (a prompt is text, a token-id list or an
OpenAI chat message list), plus ``metrics()``, ``resolved()``, ``reset_prefix_cache()`` and
``close()``. ``OfflineRunner`` wraps ``OfflineEngine`` (chat prompts go through the model's chat
template). ``ServerRunner`` drives a ``VllmServer`` or any running vLLM URL with an async HTTP client
at a bounded concurrency, greedy, with ``top_logprobs`` for the margins and vLLM's
``return_token_ids`` for exact token ids. ``run_waves`` advances episodes step by step (a step is
sent when the episode's previous answer is back, many episodes in flight, or in lock-step waves),
appends every finished request to a ``ResultsStore`` at once, and on a rerun skips what is stored.

What it deliberately does not do: build workload prompts (a ``next_step`` callback does; see
``episodes_next_step`` for ``statescope.workload.episodes`` episodes), judge outputs, or retry failed requests
(a failure stops the run; a rerun resumes). ``ServerRunner(request_log=PATH)`` appends every chat
request it sent as one JSONL line (the body, its id, start and end time): the shape of a user's
own request log, which ``statescope workload import`` reads back.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as _dt
import json
import threading
import time
from pathlib import Path
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping, Protocol, Sequence, Union, runtime_checkable

import httpx

from statescope.workload.model_files import is_multimodal
from statescope.engine.offline import OfflineEngine, RequestRecord
from statescope.engine.config import EngineConfig
from statescope.errors import EnvironmentBroken, InputError
from statescope.engine.server import VllmServer, read_metrics, read_resolved
from statescope.records import ResultsStore, load_records
from statescope.workload.images import image_urls, open_image
from statescope.workload.request_fields import kept_fields, offline_blocked

Prompt = Union[str, Sequence[int], Sequence[Mapping[str, Any]]]


class ServerRequestError(EnvironmentBroken):
    """A request to the server failed (HTTP error, timeout, or an answer without the needed fields)."""


def prompt_kind(prompt: Any, index: int = 0) -> str:
    """'text', 'tokens' or 'chat'; anything else is an InputError naming the prompt."""
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, Sequence) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return "tokens"
        if all(isinstance(m, Mapping) and "role" in m for m in prompt):
            return "chat"
    raise InputError(f"prompts[{index}]: expected a string, a non-empty list of token ids or a list "
                     f"of chat messages ({{'role':..., 'content':...}}), got {str(prompt)[:80]!r}")


def template_inputs(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for a chat template, as vLLM's chat endpoint hands them over: tools as
    vLLM's own request model dumps them, and tool-call arguments as objects, not JSON strings
    (the Transformers convention vLLM follows), so the offline prompt is the server's."""
    fields = kept_fields(messages)
    tools = None
    if fields.get("tools"):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

        tools = [ChatCompletionToolsParam.model_validate(t).model_dump() for t in fields["tools"]]
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = []
            for call in m["tool_calls"]:
                call = {**call, "function": dict(call.get("function") or {})}
                args = call["function"].get("arguments")
                if isinstance(args, str):
                    try:
                        call["function"]["arguments"] = json.loads(args) if args else {}
                    except json.JSONDecodeError:
                        pass  # left as the string: the template shows it as recorded
                calls.append(call)
            m["tool_calls"] = calls
        out.append(m)
    return out, tools


def _margin(values: Sequence[float]) -> tuple[float | None, float | None]:
    ranked = sorted(values, reverse=True) + [None, None]  # (top-1, top-1 minus top-2)
    return ranked[0], (ranked[0] - ranked[1]) if ranked[1] is not None else None


@runtime_checkable
class Runner(Protocol):
    """What ``run_waves`` and the workbook need from a driver ('offline' or 'server' ``kind``)."""

    kind: str

    def generate(self, prompts: Sequence[Prompt], *, max_tokens: int, logprobs: int = 2,
                 ignore_eos: bool = False) -> list[RequestRecord]: ...
    def metrics(self) -> dict: ...
    def resolved(self) -> dict: ...
    def reset_prefix_cache(self) -> bool: ...
    def close(self) -> None: ...


class _ClosingContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OfflineRunner(_ClosingContext):
    """Runner over an in-process ``OfflineEngine`` (started here from a config, or given)."""

    kind = "offline"

    def __init__(self, engine_or_config: OfflineEngine | EngineConfig) -> None:
        self._owns = isinstance(engine_or_config, EngineConfig)
        self.engine = OfflineEngine(engine_or_config) if self._owns else engine_or_config
        self.config: EngineConfig = self.engine.config
        self._multimodal = is_multimodal(self.config.model)
        self.last_call: dict = {}

    def engine_prompt(self, prompt: Prompt, index: int = 0) -> str | list[int] | dict:
        """What ``OfflineEngine.generate`` is given for ``prompt`` (chat: rendered and tokenized;
        with images on a vision model: the rendered text plus the decoded images)."""
        kind = prompt_kind(prompt, index)
        if kind != "chat":
            return prompt if kind == "text" else list(prompt)
        # Render then tokenize without special tokens: what vLLM's chat endpoint does, so both
        # runners see the same prompt token ids (tools included: the template renders them).
        tok = self.engine.llm.get_tokenizer()
        messages, tools = template_inputs(prompt)
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=True)
        urls = list(image_urls(prompt))
        if urls and not self._multimodal:
            raise InputError(f"prompts[{index}]: {len(urls)} image(s), but {self.config.model} is a "
                             "text-only model (a server refuses them too): use a vision model, or "
                             "import the log with --drop-images")
        if urls:
            # The template wrote one placeholder per image; vLLM's processor expands each to the
            # image's tokens (what the server does with the same messages).
            try:
                images = [open_image(u) for u in urls]
            except ValueError as exc:
                raise InputError(f"prompts[{index}]: image: {exc}") from exc
            return {"prompt": text, "multi_modal_data": {"image": images}}
        return list(tok.encode(text, add_special_tokens=False))

    def generate(self, prompts: Sequence[Prompt], *, max_tokens: int, logprobs: int = 2,
                 ignore_eos: bool = False) -> list[RequestRecord]:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            blocked = offline_blocked(kept_fields(p))
            if blocked:  # the engine is given a prompt, not a body: it cannot apply this field
                raise InputError(f"prompts[{i}]: request field {blocked!r} is not applied by the "
                                 "offline runner; replay the trace with a server runner "
                                 "(--runner server or a URL)")
            if logprobs:  # ask for as many top logprobs as the request did (never fewer)
                logprobs = max(logprobs, int(kept_fields(p).get("top_logprobs") or 0))
        inputs = [self.engine_prompt(p, i) for i, p in enumerate(prompts)]
        records = self.engine.generate(inputs, max_tokens=max_tokens, logprobs=logprobs,
                                       ignore_eos=ignore_eos)
        engine_s = records[0].latency_s if records else 0.0
        self.last_call = {"wall_s": time.perf_counter() - t0, "engine_s": engine_s}
        return records

    def metrics(self) -> dict:
        return self.engine.metrics()

    def resolved(self) -> dict:
        return self.engine.resolved()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        if self._owns:
            self.engine.close()


@dataclass
class _Session:
    """One event loop's HTTP client and in-flight limit (shared by every request of a run)."""

    client: httpx.AsyncClient
    limit: asyncio.Semaphore


def _run_sync(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # Called from inside a running loop (a notebook): run on a private loop in a helper thread.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class ServerRunner(_ClosingContext):
    """Runner over a vLLM OpenAI-compatible server: a ``VllmServer`` or the URL of a running one."""

    kind = "server"

    def __init__(self, server_or_url: VllmServer | str, *, concurrency: int = 32,
                 request_timeout_s: float = 120.0, model: str | None = None,
                 owns_server: bool = False, request_log: str | Path | None = None) -> None:
        if not isinstance(concurrency, int) or concurrency < 1:
            raise InputError(f"ServerRunner concurrency: expected an integer >= 1, got {concurrency!r}")
        self.server = server_or_url if isinstance(server_or_url, VllmServer) else None
        if self.server is None and not (isinstance(server_or_url, str)
                                        and server_or_url.startswith(("http://", "https://"))):
            raise InputError(f"ServerRunner server_or_url: expected a VllmServer or an http(s) URL, "
                             f"got {server_or_url!r}")
        self.url = (self.server.url if self.server else server_or_url).rstrip("/")
        self.config: EngineConfig | None = self.server.config if self.server else None
        self.concurrency, self.request_timeout_s = concurrency, request_timeout_s
        self._owns = owns_server and self.server is not None
        self.model = model or (self.server.served_model if self.server else self._first_model())
        self.last_call: dict = {}
        # A JSONL request log like a user's own: the body sent, its id, start and end times.
        self.request_log = Path(request_log) if request_log else None
        self._log_lock = threading.Lock()

    def _log_request(self, body: dict, data: dict, t_start: float, t_end: float) -> None:
        line = {"request_id": data.get("id"), "timestamp": round(t_start, 6),
                "end_timestamp": round(t_end, 6), **body}
        with self._log_lock, self.request_log.open("a") as fh:
            fh.write(json.dumps(line, ensure_ascii=False) + "\n")

    @classmethod
    def launch(cls, config: EngineConfig, *, concurrency: int = 32, request_timeout_s: float = 120.0,
               request_log: str | Path | None = None, **server_kwargs: Any) -> "ServerRunner":
        """Start a ``VllmServer`` for ``config``; the runner closes it."""
        return cls(VllmServer(config, **server_kwargs), concurrency=concurrency,
                   request_timeout_s=request_timeout_s, owns_server=True, request_log=request_log)

    def _first_model(self) -> str:
        try:
            r = httpx.get(self.url + "/v1/models", timeout=self.request_timeout_s)
            r.raise_for_status()
            return r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise ServerRequestError(f"{self.url}/v1/models: expected a vLLM server listing one "
                                     f"model ({exc})") from exc

    @asynccontextmanager
    async def session(self) -> AsyncIterator[_Session]:
        limits = httpx.Limits(max_connections=self.concurrency,
                              max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(base_url=self.url, limits=limits,
                                     timeout=self.request_timeout_s) as client:
            yield _Session(client, asyncio.Semaphore(self.concurrency))

    def _body(self, prompt: Prompt, kind: str, max_tokens: int, logprobs: int,
              ignore_eos: bool) -> tuple[str, dict]:
        fields = kept_fields(prompt)
        # the request's own kept fields (tools, stop, ...) as recorded; the runner's own keys win
        body: dict[str, Any] = {**fields, "model": self.model, "max_tokens": max_tokens,
                                "temperature": 0.0,
                                "ignore_eos": bool(ignore_eos or fields.get("ignore_eos")),
                                # exact ids of prompt and output, and top-k keys that cannot
                                # collide the way two tokens decoding to one string would
                                "return_token_ids": True, "return_tokens_as_token_ids": True}
        if kind == "chat":
            body["messages"] = [dict(m) for m in prompt]
            if logprobs:
                body.update(logprobs=True,
                            top_logprobs=max(logprobs, int(fields.get("top_logprobs") or 0)))
            else:
                body.pop("top_logprobs", None)
            return "/v1/chat/completions", body
        body["prompt"] = prompt if kind == "text" else list(prompt)
        if logprobs:
            body["logprobs"] = logprobs
        return "/v1/completions", body

    @staticmethod
    def _record(kind: str, data: dict, latency_s: float) -> RequestRecord:
        choice = data["choices"][0]
        if kind == "chat":
            text = choice["message"].get("content") or ""
            prompt_ids = data.get("prompt_token_ids")
            per_pos = [[t["logprob"] for t in c.get("top_logprobs", [])]
                       for c in ((choice.get("logprobs") or {}).get("content") or [])]
        else:
            text = choice.get("text") or ""
            prompt_ids = choice.get("prompt_token_ids")
            per_pos = [list((d or {}).values())
                       for d in ((choice.get("logprobs") or {}).get("top_logprobs") or [])]
        out_ids = choice.get("token_ids")
        if out_ids is None or prompt_ids is None:
            raise ServerRequestError("server answer lacks token ids: expected a vLLM server that "
                                     "honours return_token_ids")
        pairs = [_margin(v) for v in per_pos]
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        return RequestRecord(
            request_id=data.get("id", ""), prompt_token_ids=list(prompt_ids),
            output_token_ids=list(out_ids), text=text,
            # None when the server does not report it (started without --enable-prompt-tokens-details)
            num_cached_tokens=details.get("cached_tokens"), finish_reason=choice.get("finish_reason"),
            logprobs=[p[0] for p in pairs], margins=[p[1] for p in pairs], latency_s=latency_s)

    async def _one(self, session: _Session, prompt: Prompt, index: int, max_tokens: int,
                   logprobs: int, ignore_eos: bool) -> RequestRecord:
        kind = prompt_kind(prompt, index)
        path, body = self._body(prompt, kind, max_tokens, logprobs, ignore_eos)
        async with session.limit:
            t0, wall0 = time.perf_counter(), time.time()
            try:
                r = await session.client.post(path, json=body)
            except httpx.TimeoutException as exc:
                raise ServerRequestError(f"{self.url}{path}: no answer within "
                                         f"{self.request_timeout_s} s ({type(exc).__name__})") from exc
            except httpx.TransportError as exc:
                raise ServerRequestError(f"{self.url}{path}: connection failed ({exc})") from exc
            latency = time.perf_counter() - t0
        if r.status_code == 400 and logprobs and "not JSON compliant" in r.text:
            # NaN logprobs (a state gone to NaN — the `!!!!` symptom) make vLLM's server fail the
            # whole answer. Ask again without logprobs so the user-visible text is recorded.
            return await self._one(session, prompt, index, max_tokens, 0, ignore_eos)
        if r.status_code != 200:
            raise ServerRequestError(f"{self.url}{path} answered HTTP {r.status_code} for "
                                     f"prompts[{index}]: {r.text[:400]}")
        data = r.json()
        if self.request_log is not None and kind == "chat":
            self._log_request(body, data, wall0, wall0 + latency)
        return self._record(kind, data, latency)

    async def agenerate(self, prompts: Sequence[Prompt], *, max_tokens: int, logprobs: int = 2,
                        ignore_eos: bool = False, session: _Session | None = None) -> list[RequestRecord]:
        """Send all prompts concurrently (at most ``concurrency`` in flight); results in input order."""
        for i, p in enumerate(prompts):
            prompt_kind(p, i)  # reject bad input before anything is sent
        if session is None:
            async with self.session() as own:
                return await self.agenerate(prompts, max_tokens=max_tokens, logprobs=logprobs,
                                            ignore_eos=ignore_eos, session=own)
        return list(await asyncio.gather(*(self._one(session, p, i, max_tokens, logprobs,
                                                     ignore_eos) for i, p in enumerate(prompts))))

    def generate(self, prompts: Sequence[Prompt], *, max_tokens: int, logprobs: int = 2,
                 ignore_eos: bool = False) -> list[RequestRecord]:
        t0, c0 = time.perf_counter(), time.process_time()
        records = _run_sync(self.agenerate(prompts, max_tokens=max_tokens, logprobs=logprobs,
                                           ignore_eos=ignore_eos))
        self.last_call = {"wall_s": time.perf_counter() - t0, "driver_cpu_s": time.process_time() - c0,
                          "request_s": sum(r.latency_s or 0.0 for r in records)}
        return records

    def metrics(self) -> dict:
        return read_metrics(self.url, self.request_timeout_s)

    def resolved(self) -> dict:
        if self.server is not None:
            return self.server.resolved()
        return read_resolved(self.url, timeout_s=self.request_timeout_s)

    def reset_prefix_cache(self, attempts: int = 20) -> bool:
        """POST /reset_prefix_cache (a development endpoint); retried while requests hold blocks."""
        for _ in range(attempts):
            r = httpx.post(self.url + "/reset_prefix_cache", timeout=self.request_timeout_s)
            if r.status_code == 404:
                raise EnvironmentBroken(f"{self.url} has no /reset_prefix_cache: start the server "
                                        "with VLLM_SERVER_DEV_MODE=1 (VllmServer does)")
            r.raise_for_status()
            if r.json().get("success"):
                return True
            time.sleep(0.25)
        return False

    def close(self) -> None:
        if self._owns:
            self.server.close()


# -- multi-step driver ------------------------------------------------------------------------
@dataclass(frozen=True)
class StepRequest:
    """The next request of one episode: ``step`` counts from 0 within ``episode``."""

    episode: str
    step: int
    prompt: Prompt
    source: str | None = None  # where the step came from ("trace.jsonl:12"), for errors


# next_step(episode_id, history) -> the episode's next StepRequest, or None when it is finished.
# history holds the stored rows of the episode's earlier steps in step order (answer = row['text']).
NextStep = Callable[[str, list[dict]], Union[StepRequest, None]]


def episodes_next_step(episodes: Sequence[Any], system_repeat: int = 6) -> NextStep:
    """A ``next_step`` for ``statescope.workload.episodes`` episodes (prompt = ``workload.step_prompt``).

    It rewrites each episode's ``answers`` from the stored history, so a resumed run rebuilds
    exactly the prompts the interrupted one would have sent."""
    from statescope.workload.episodes import step_prompt

    by_id = {e.episode_id: e for e in episodes}

    def next_step(episode_id: str, history: list[dict]) -> StepRequest | None:
        ep, step = by_id[episode_id], len(history)
        if step >= len(ep.observations):
            return None
        ep.answers[:] = [row["text"] for row in history]
        return StepRequest(episode_id, step, step_prompt(ep, step, system_repeat))

    return next_step


def _stored_history(store: ResultsStore, build: str, config_hash: str,
                    episodes: Sequence[str]) -> dict[str, list[dict]]:
    history: dict[str, list[dict]] = {e: [] for e in episodes}
    rows = load_records(store.run_dir).to_dict("records") if store.completed_keys() else []
    for row in rows:
        if row["build"] == build and row["config_hash"] == config_hash and row["episode"] in history:
            history[row["episode"]].append(row)
    for ep, ep_rows in history.items():
        ep_rows.sort(key=lambda r: int(r["step"]))
        steps = [int(r["step"]) for r in ep_rows]
        if steps != list(range(len(steps))):
            raise InputError(f"{store.records_path}: episode {ep!r} has stored steps {steps}; "
                             "expected consecutive steps from 0 (was it written by run_waves?)")
    return history


TOO_LONG = ("longer than the maximum model length", "maximum context length")


def _name_too_long(exc: BaseException, reqs: Sequence[StepRequest]) -> None:
    """vLLM refuses a prompt longer than the model length naming no request: say which step."""
    text = str(exc)
    if not any(marker in text for marker in TOO_LONG):
        return
    where = ", ".join(f"{r.source + ': ' if r.source else ''}episode {r.episode!r} step {r.step}"
                      for r in reqs[:4]) + (f" (and {len(reqs) - 4} more)" if len(reqs) > 4 else "")
    raise InputError(f"{where}: the prompt does not fit the engine's max_model_len "
                     f"({text.strip().splitlines()[0][:300]})") from exc


def run_waves(runner: Runner, episodes: Sequence[str], next_step: NextStep, store: ResultsStore, *,
              build: str, config_hash: str, max_tokens: int = 32, logprobs: int = 2,
              ignore_eos: bool = False, all_at_once: bool = False,
              row_fields: dict | None = None, progress: Any = None,
              on_stored: Callable[[dict], None] | None = None) -> list[dict]:
    """Drive every episode to its end; returns the rows appended by this call (resume-safe).
    ``row_fields`` are added to every row this call stores (e.g. its ``engine_lifetime``);
    ``on_stored(row)`` is called after each row is stored (e.g. to write the engine's counters
    as it goes).

    Default: each episode sends its next step as soon as its previous answer is stored, with up
    to the runner's concurrency in flight. ``all_at_once=True`` (always so for runners without
    ``agenerate``, e.g. ``OfflineRunner``) runs lock-step waves: the next step of every unfinished
    episode is sent together, and the next wave waits for the whole wave. ``progress``
    (``statescope.progress.Progress``) advances once per stored request; rows already stored by
    an interrupted run count as done.
    """
    from statescope.progress import progress_or_null

    if len(set(episodes)) != len(episodes):
        raise InputError("run_waves episodes: expected distinct episode ids")
    bar = progress_or_null(progress)
    history = _stored_history(store, build, config_hash, episodes)
    stored = sum(len(h) for h in history.values())
    if stored:
        bar.start_from(bar.done + stored)
    new_rows: list[dict] = []

    def next_of(ep: str) -> StepRequest | None:
        req = next_step(ep, list(history[ep]))
        if req is not None and (req.episode != ep or req.step != len(history[ep])):
            raise InputError(f"run_waves next_step({ep!r}): expected StepRequest(episode={ep!r}, "
                             f"step={len(history[ep])}), got ({req.episode!r}, {req.step})")
        return req

    def store_row(req: StepRequest, rec: RequestRecord) -> None:
        row = {"run_id": store.run_id, "build": build, "config_hash": config_hash,
               "episode": req.episode, "step": req.step, "runner": runner.kind,
               "prompt": req.prompt, **rec.to_dict(), **(row_fields or {}),
               "completed_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")}
        store.append(row)  # flushed and fsync'd before the next step of this episode is built
        history[req.episode].append(row)
        new_rows.append(row)
        bar.advance()
        if on_stored is not None:
            on_stored(row)

    gen_kw = dict(max_tokens=max_tokens, logprobs=logprobs, ignore_eos=ignore_eos)
    if not hasattr(runner, "agenerate"):
        while wave := [r for ep in episodes if (r := next_of(ep)) is not None]:
            try:
                records = runner.generate([r.prompt for r in wave], **gen_kw)
            except Exception as exc:
                _name_too_long(exc, wave)
                raise
            for req, rec in zip(wave, records):
                store_row(req, rec)
        return new_rows

    async def send(session: _Session, req: StepRequest) -> None:
        try:
            rec = (await runner.agenerate([req.prompt], session=session, **gen_kw))[0]
        except Exception as exc:
            _name_too_long(exc, [req])
            raise
        store_row(req, rec)

    async def episode_loop(session: _Session, ep: str) -> None:
        while (req := next_of(ep)) is not None:
            await send(session, req)

    async def drive() -> None:
        async with runner.session() as session:
            if all_at_once:
                while wave := [r for ep in episodes if (r := next_of(ep)) is not None]:
                    async with asyncio.TaskGroup() as tg:
                        for req in wave:
                            tg.create_task(send(session, req))
            else:
                async with asyncio.TaskGroup() as tg:
                    for ep in episodes:
                        tg.create_task(episode_loop(session, ep))

    try:
        _run_sync(drive())
    except BaseExceptionGroup as group:  # TaskGroup wraps failures; surface the first one
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from group
    return new_rows
