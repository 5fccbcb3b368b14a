"""Live streaming on the OpenAI routes: text goes out while the sample still runs.

Ordering evidence without clocks: the gateway runs against a scripted coordinator that delivers a sample's
progress (the worker's `SampleProgress`) and its result only when the test says so, and the official `openai`
client must receive the first text before the test lets the sample finish. The worker side (progress reported
during the decode) is tests/test_sampling_topk.py's; the whole chain on a real cluster is below.
"""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest
from aiohttp import web
from conftest import BASE

from bios import messages as m
from bios import types as t
from bios.gateway.openai_api import OpenAICompat
from bios.models.builtin import byte_level_tokenizer

KEY = "tml-openai-test"


class _ScriptedCoordinator:
    """What OpenAICompat needs of a coordinator, with samples that finish when the test says."""

    def __init__(self) -> None:
        self.front_door = self
        self.on_done = None
        self.submitted: asyncio.Queue[m.Sample] = asyncio.Queue()

    def attach(self, name, on_done):
        self.on_done = on_done
        return b"local:test"

    def authenticate(self, key):
        return "local"

    def open_session(self, owner):
        return "s"

    async def query(self, body, owner="local"):
        assert isinstance(body, m.CreateSamplingSession)
        return m.SamplingSession("s:sample:0", BASE, None)

    async def submit(self, peer, op, owner="local"):
        await self.submitted.put(op)
        return m.Accepted(f"{op.sampling_session_id}:{op.seq_id}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_first_text_arrives_before_the_sample_finishes(chat):
    from bios import ids

    text = "Streaming, live!"
    tokens = list(text.encode()) + [257]  # then EOS
    first = tokens[:5]

    async def main():
        coordinator = _ScriptedCoordinator()
        gateway = OpenAICompat(coordinator, coordinator)  # its front door and accounts
        gateway.tokenizers[BASE] = byte_level_tokenizer()
        app = web.Application()
        app.add_routes(gateway.routes())
        runner = web.AppRunner(app, shutdown_timeout=2.0)  # a failed test may leave a stream open
        await runner.setup()
        port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=30)
        try:
            if chat:
                gateway.tokenizers[BASE] = _with_template(byte_level_tokenizer())
                call = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=32, stream=True, logprobs=True, top_logprobs=1)
            else:
                call = client.completions.create(model=BASE, prompt="hi", max_tokens=32, stream=True, logprobs=1)
            request = asyncio.ensure_future(call)
            op = await coordinator.submitted.get()
            assert op.stream and op.topk_sample_logprobs == 1
            request_id = ids.request_id(op.sampling_session_id, op.seq_id)
            top = t.TopkLogprobs(t.TensorData([[tok] for tok in first], "int64"),
                                 t.TensorData([[-0.5]] * len(first), "float32"))
            coordinator.on_done(m.SampleProgress(1, request_id, [0], [
                t.SampledSequence("length", first, [-0.5] * len(first), topk_logprobs=top)]))
            stream = await request
            received = []
            async for chunk in stream:
                piece = chunk.choices[0].delta.content if chat else chunk.choices[0].text
                if piece:
                    received.append(piece)
                    break
            # the sample has not finished (its result is not even sent): what arrived is its first token's text
            assert received == [text[0]]
            top = t.TopkLogprobs(t.TensorData([[tok] for tok in tokens], "int64"),
                                 t.TensorData([[-0.5]] * len(tokens), "float32"))
            coordinator.on_done(m.RequestDone(request_id, t.SampleResponse([t.SampledSequence(
                "stop", tokens, [-0.5] * len(tokens), topk_logprobs=top)])))
            finish = None
            logprobs = 0
            async for chunk in stream:
                choice = chunk.choices[0]
                received.append((choice.delta.content if chat else choice.text) or "")
                finish = choice.finish_reason or finish
                if choice.logprobs is not None:
                    logprobs += len(choice.logprobs.content if chat else choice.logprobs.tokens)
            assert "".join(received) == text and finish == "stop"
            assert logprobs == len(tokens) - 1  # the later tokens' (the first chunk carried the first one's)
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(main())


def _with_template(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


def test_a_live_stream_on_a_cluster_equals_the_whole_response(cluster):
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
        kwargs = {"model": BASE, "prompt": ["The quick brown", "Hello"], "max_tokens": 64, "temperature": 0.7, "seed": 4, "n": 2,
                      "logprobs": 2}
        whole = client.completions.create(**kwargs)
        chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        for choice in whole.choices:
            mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
            assert "".join(c.text for c in mine) == choice.text
            assert [lp for c in mine if c.logprobs for lp in c.logprobs.token_logprobs] == \
                pytest.approx(choice.logprobs.token_logprobs)
            assert [top for c in mine if c.logprobs for top in c.logprobs.top_logprobs] == choice.logprobs.top_logprobs
            assert mine[-1].finish_reason == choice.finish_reason
            assert len([c for c in mine if c.text]) > 1
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        # a refusal is still an HTTP error: nothing was sent before it
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            list(client.completions.create(model=BASE, prompt="hi", max_tokens=10**6, stream=True))


def test_a_result_that_does_not_continue_the_streamed_text_is_an_error_not_a_silent_splice():
    """A sample whose cycle aborted after progress was streamed runs again and may draw other tokens: the stream
    must say so rather than append the new sample's tail to the old one's head."""
    from bios.gateway.openai_choices import ChoiceStream, StreamDiverged

    tokenizer = byte_level_tokenizer()
    first, other = tokenizer.encode("hello there"), tokenizer.encode("goodbye now")
    stream = ChoiceStream(tokenizer, 0, [], None)
    stream.add(0, t.SampledSequence(stop_reason="length", tokens=first[:6], logprobs=[-0.1] * 6))
    assert "".join(c.text for c in stream.ready()) == "hello "
    with pytest.raises(StreamDiverged, match="ran again after a worker failed"):
        stream.final(t.SampledSequence(stop_reason="length", tokens=other, logprobs=[-0.1] * len(other)))
    again = ChoiceStream(tokenizer, 0, [], None)
    again.add(0, t.SampledSequence(stop_reason="length", tokens=first[:6], logprobs=[-0.1] * 6))
    again.ready()
    rest, whole = again.final(t.SampledSequence(stop_reason="length", tokens=first, logprobs=[-0.1] * len(first)))
    assert rest.text == "there" and whole.text == "hello there"
