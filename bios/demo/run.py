"""The demo job: evaluate a base model, LoRA-fine-tune it on the embedded cluster, evaluate again.

Everything goes through the public SDK, as a user's script would: a `ServiceClient` starts an embedded
cluster, the scored questions are sampled concurrently (`asyncio.gather` over `sample_async`, so the cluster
batches them), and training keeps `pipeline_depth` steps in flight so the worker always
has the next step queued when a cycle ends.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from dataclasses import dataclass, field

from tqdm import tqdm

from bios import types
from bios.sdk.futures import APIFuture
from bios.sdk.local_cluster import LocalCluster
from bios.sdk.sampling import SamplingClient
from bios.sdk.service import ServiceClient
from bios.sdk.training import TrainingClient

from .tasks import ChatFormat, Example, Task, is_correct

# One local worker and nothing to fail over to: a laptop busy with other work must not get it declared dead.
HEARTBEAT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class DemoSettings:
    task: str
    base_model: str
    steps: int
    batch_size: int
    learning_rate: float
    final_learning_rate: float  # linear decay to this by the last step
    rank: int
    seed: int
    grad_clip_norm: float = 1.0  # a bad batch nudges the adapter instead of throwing it off
    pipeline_depth: int = 2


@dataclass(frozen=True)
class Evaluation:
    score: float  # fraction of the scored questions answered correctly
    answers: list[str]
    correct: list[bool]
    seconds: float


@dataclass
class TrainingLog:
    losses: list[float] = field(default_factory=list)  # mean loss per answer token, one per step
    tokens: int = 0  # tokens through the model (prompt and answer)
    seconds: float = 0.0


@dataclass(frozen=True)
class DemoResult:
    settings: DemoSettings
    task: Task
    before: Evaluation
    after: Evaluation
    training: TrainingLog
    timings: dict[str, float]


def run_demo_job(settings: DemoSettings, task: Task) -> DemoResult:
    started = time.monotonic()
    timings: dict[str, float] = {}
    print(f"starting an embedded Bios cluster (coordinator + 1 worker) and loading {settings.base_model}...")
    with ServiceClient(cluster=LocalCluster(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)) as service:
        tc = service.create_lora_training_client(settings.base_model, rank=settings.rank, seed=settings.seed)
        chat = ChatFormat(tc.get_tokenizer(), task.system)
        timings["startup_s"] = time.monotonic() - started

        print(f"evaluating the base model on {len(task.eval)} {task.scored_on}...")
        base = service.create_sampling_client(base_model=settings.base_model)
        before = asyncio.run(evaluate(base, chat, task.eval, task.keys, task.max_tokens))
        print(f"before fine-tuning: {before.score:.0%} correct ({before.seconds:.0f}s)")

        training = train(tc, chat, task.train, settings)
        timings["training_s"] = training.seconds

        tuned = tc.save_weights_and_get_sampling_client("demo")
        after = asyncio.run(evaluate(tuned, chat, task.eval, task.keys, task.max_tokens))
    timings["eval_before_s"] = before.seconds
    timings["eval_after_s"] = after.seconds
    timings["total_s"] = time.monotonic() - started
    return DemoResult(settings, task, before, after, training, timings)


async def evaluate(sampler: SamplingClient, chat: ChatFormat, examples: list[Example], keys: list[str],
                   max_tokens: int) -> Evaluation:
    """Greedy answers to every question, all submitted at once: requests that arrive while a cycle runs go
    together into the next one, so the whole set costs two or so batched generations instead of one per question."""
    started = time.monotonic()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    responses = await asyncio.gather(*(
        sampler.sample_async(types.ModelInput.from_ints(chat.prompt(example.question)), 1, params)
        for example in examples
    ))
    answers = [chat.decode(response.sequences[0].tokens) for response in responses]
    correct = [is_correct(answer, example, keys) for answer, example in zip(answers, examples)]
    return Evaluation(sum(correct) / len(correct), answers, correct, time.monotonic() - started)


def batches(examples: list[Example], batch_size: int, steps: int, seed: int) -> list[list[Example]]:
    """`steps` batches from seeded reshuffles of the training set (an epoch's leftovers start the next batch)."""
    rng = random.Random(seed)
    stream: list[Example] = []
    while len(stream) < steps * batch_size:
        epoch = list(examples)
        rng.shuffle(epoch)
        stream += epoch
    return [stream[i * batch_size:(i + 1) * batch_size] for i in range(steps)]


def learning_rate(settings: DemoSettings, step: int) -> float:
    fraction = step / max(1, settings.steps - 1)
    return settings.learning_rate + fraction * (settings.final_learning_rate - settings.learning_rate)


def train(tc: TrainingClient, chat: ChatFormat, examples: list[Example], settings: DemoSettings) -> TrainingLog:
    """`steps` optimizer steps of cross-entropy on the answers, `pipeline_depth` steps in flight."""
    data = {example: chat.datum(example) for example in examples}
    log = TrainingLog()
    in_flight: deque[tuple[APIFuture[types.ForwardBackwardOutput], APIFuture[types.OptimStepResponse], int, int]]
    in_flight = deque()
    bar = tqdm(total=settings.steps, desc="fine-tuning", unit="step", dynamic_ncols=True)
    started = time.monotonic()

    def finish() -> None:
        fwd, opt, tokens, answer_tokens = in_flight.popleft()
        log.losses.append(fwd.result().loss / answer_tokens)
        opt.result()
        log.tokens += tokens
        elapsed = time.monotonic() - started
        bar.set_postfix(loss=f"{log.losses[-1]:.3f}", tok_s=f"{log.tokens / elapsed:.0f}")
        bar.update(1)

    for step, batch in enumerate(batches(examples, settings.batch_size, settings.steps, settings.seed)):
        datums = [data[example] for example in batch]
        fwd = tc.forward_backward(datums, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=learning_rate(settings, step),
                                             grad_clip_norm=settings.grad_clip_norm))
        tokens = sum(d.model_input.length for d in datums)
        answer_tokens = int(sum(d.loss_fn_inputs["weights"].to_numpy().sum() for d in datums))
        in_flight.append((fwd, opt, tokens, answer_tokens))
        while len(in_flight) >= settings.pipeline_depth:
            finish()
    while in_flight:
        finish()
    bar.close()
    log.seconds = time.monotonic() - started
    return log
