"""A tensor-parallel server against the openai package: `nibble serve --tensor-parallel-size 3`
on the default model (SmolLM2's 9 heads and 3 KV heads split three ways), its ranks on CPU
threads. Rank 0 serves HTTP and mirrors its engine's calls to the other ranks' engines, so the
ranks must stay in step whatever arrives when: greedy replies are the one-rank server's, the
same sent at once as one by one, and the server ends cleanly on SIGTERM."""
import subprocess
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import Server

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Water boils at", "Once upon a time", "def fib(n):",
           "The three primary colors are", "In 1969,"]


@pytest.fixture(scope="module")
def tp_server():
    s = Server("--device", "cpu", "--tensor-parallel-size", "3")
    yield s
    s.proc.terminate()
    try:
        s.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        s.proc.kill()
        pytest.fail("the tensor-parallel server did not end within 30 s of SIGTERM")
    finally:
        s.log.close()


def complete(server, prompt, **kw):
    c = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, **kw)
    return r.choices[0].text


def test_greedy_reply_is_the_one_rank_reply(tp_server):
    assert complete(tp_server, "The capital of France is").startswith(" Paris.\n\nThe answer is:")


def test_replies_at_once_are_replies_one_by_one(tp_server, server):
    alone = [complete(tp_server, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: complete(tp_server, p), PROMPTS))
    assert together == alone
    # And the one-rank server (conftest's) writes the same text.
    assert [complete(server, p) for p in PROMPTS] == alone


def test_streaming_and_abandoned_requests(tp_server):
    c = openai.OpenAI(base_url=tp_server.base + "/v1", api_key="unused", max_retries=0, timeout=300)
    stream = c.completions.create(model=MODEL, prompt="Hello", max_tokens=40, stream=True)
    # Leave after two chunks: rank 0 aborts the request and the other ranks abort it too.
    for i, _ in enumerate(stream):
        if i == 1:
            break
    stream.close()
    assert complete(tp_server, "The capital of France is").startswith(" Paris.")
