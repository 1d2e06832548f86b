"""The offline API: `LLM(model, **engine_args).generate(prompts, sampling_params)` on the same engine."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from helexa.config import EngineConfig
from helexa.engine.engine import Engine
from helexa.engine.interface import RequestHandle
from helexa.engine.stream import TokenLogprob
from helexa.model.sampling import SamplingParams


@dataclass(frozen=True)
class RequestTimings:
    """Wall-clock timings of one request, in seconds (`ttft`: submit to first token)."""

    ttft: float
    total: float
    inter_token: tuple[float, ...]  # gaps between consecutive output tokens

    @property
    def decode_tokens_per_second(self) -> float:
        gaps = sum(self.inter_token)
        return len(self.inter_token) / gaps if gaps > 0 else 0.0


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's result: the generated text and ids, why it finished, and its timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None
    timings: RequestTimings


class LLM:
    """Offline generation without a server (research, benchmarks).

    `model`: a model directory or known name (None: the default model); `engine_args`: any
    `EngineConfig` field (e.g. `num_blocks=512`, `dtype="bfloat16"`, `max_num_seqs=16`).
    `generate` submits every prompt (those that do not fit yet wait for blocks, FIFO) and drives the
    engine on the calling thread until all are done. `generate` without `sampling_params` samples with
    `get_default_sampling_params()`: the model's generation_config.json defaults (see
    `generation_config` in `EngineConfig`: "auto", "none" or a folder).

    `tensor_parallel_size=N` shards the model over N processes (`helexa.engine.parallel`); the workers are
    fresh interpreters that import nothing of the calling script, so no `if __name__ == "__main__":`
    guard is needed. `close()` (or a `with` block) stops them; they also stop when this process exits.
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        engine_args.setdefault("max_queue_depth", 1 << 20)
        self.engine = Engine(EngineConfig.of(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Abort anything still queued or running and stop the engine's tensor-parallel workers (idempotent)."""
        self.engine.shutdown(0.0)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """The `SamplingParams` `generate` uses when given none, as vLLM's method of this name.

        The fields the model's generation config sets (temperature, top_p, top_k, min_p,
        repetition_penalty; max_new_tokens as max_tokens), `SamplingParams`' defaults for the rest
        (max_tokens 16). With `generation_config="none"`, or no such file: `SamplingParams()`.
        """
        return self.engine.sampling_defaults.params()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids); results in prompt order.

        `sampling_params`: one for every prompt, or one per prompt, used as given; None:
        `get_default_sampling_params()`.

        Raises `AdmissionRejected` when a prompt can never fit this engine (its arithmetic in the
        message) before anything runs; `ValueError` for bad prompts or params.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[assignment]  # one prompt (text or token ids): a list of one
        params_list = _params_per_prompt(
            self.get_default_sampling_params() if sampling_params is None else sampling_params, len(prompts)
        )
        encoded = [self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        submitted: list[tuple[RequestHandle, float]] = []
        try:
            for ids, params in zip(encoded, params_list):
                submitted.append((self.engine.submit(ids, params), time.monotonic()))
        except Exception:
            for handle, _ in submitted:
                self.engine.abort(handle.request_id)
            self._drain()
            raise
        collected = [_Collector() for _ in submitted]
        bar = tqdm(total=len(submitted), desc="generate", unit="req", disable=not use_tqdm)
        done = 0
        while done < len(submitted):
            self.engine.step()
            now = time.monotonic()
            for (handle, _), acc in zip(submitted, collected):
                while not acc.finished and (event := handle.stream.get(timeout=0)) is not None:
                    acc.add(event, now)
                    if acc.finished:
                        done += 1
                        bar.update(1)
        bar.close()
        return [
            acc.output(handle, prompt if isinstance(prompt, str) else None, ids, start)
            for (handle, start), acc, prompt, ids in zip(submitted, collected, prompts, encoded)
        ]

    def _drain(self) -> None:
        for _ in range(10_000):
            if not self.engine.step() and not self.engine.has_work():
                return


class _Collector:
    def __init__(self) -> None:
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.token_times: list[float] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.finished = False

    def add(self, event, now: float) -> None:
        self.text.append(event.text)
        self.ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        self.token_times.extend([now] * len(event.token_ids))
        if event.finished:
            self.finished, self.finish_reason, self.error = True, event.finish_reason, event.error

    def output(self, handle: RequestHandle, prompt: str | None, ids: list[int], start: float) -> RequestOutput:
        if self.error is not None:
            raise self.error
        times = self.token_times
        timings = RequestTimings(
            ttft=(times[0] - start) if times else 0.0,
            total=(times[-1] - start) if times else 0.0,
            inter_token=tuple(b - a for a, b in zip(times, times[1:])),
        )
        return RequestOutput(
            handle.request_id,
            prompt,
            ids,
            "".join(self.text),
            self.ids,
            self.finish_reason or "abort",
            self.logprobs or None,
            timings,
        )


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
