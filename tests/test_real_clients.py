"""Third-party clients against the OpenAI-compatible HTTP API: lm-evaluation-harness and guidellm.

Everything is real: `expertmesh up --http-port 0` over a tiny Mixtral with its own byte-level tokenizer
(and a chat template), and the released clients run as their own commands, lm-eval 0.4.13 (its
``local-completions`` model on a multiple-choice log-likelihood task and a ``generate_until`` task, both
written into the test's tmp dir) and guidellm 0.8.1 (a synthetic workload at a constant rate, chat and
completions, streamed). lm-eval's log-likelihoods must equal the gRPC Score API's for the same tokens, its
generations the gRPC API's greedy ones; guidellm must finish every request without an error.

The clients live in a venv of their own, ``build/clients-venv``, made by ``make clients-venv`` (python3 -m
venv; pinned CPU torch first, then the pinned ``lm-eval[api]`` and ``guidellm``); lm-eval's pins conflict
with the main venv's. ``make test`` builds it before pytest; without it this module fails naming the target.
Offline throughout: ``HF_HUB_OFFLINE``, the tasks' data as local jsonl, the tokenizer by path.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from expertmesh.client import Client
from expertmesh.models.tiny import make_tiny_checkpoint
from helpers import serving_http

pytestmark = pytest.mark.slow

CLIENTS_VENV = Path(__file__).resolve().parents[1] / "build" / "clients-venv"
CONTEXT = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
#: lm-eval's multiple-choice items; it scores " " + choice after the question (``target_delimiter``)
CHOICE_ITEMS = [
    {"question": "The sky is", "choices": ["blue", "green", "made of cheese"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Fahrenheit", "Kelvin"], "answer": 0},
]
GENERATION_ITEMS = [
    {"question": "Q: Say hello.\nA:", "answer": " hello"},
    {"question": "Q: Count to three.\nA:", "answer": " 1 2 3"},
]
MAX_GEN_TOKS = 8
#: the tasks' lm-eval configs (JSON is YAML), each over a jsonl of the items above
TASKS = {
    "em_choice": {
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "target_delimiter": " ",
        "metric_list": [{"metric": "acc"}],
    },
    "em_generate": {
        "output_type": "generate_until",
        "doc_to_text": "{{question}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": MAX_GEN_TOKS, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}],
    },
}


def _tool(name: str) -> Path:
    tool = CLIENTS_VENV / "bin" / name
    if not tool.exists():
        pytest.fail(f"{tool} is missing: build the clients venv with `make clients-venv` (make test builds it first)")
    return tool


def _run(args: list, tmp: Path, timeout: float = 300, **env: str) -> str:
    """A client command in the clients venv, offline, with caches under ``tmp``; its output, or the test fails
    with it."""
    environment = {
        "PATH": f"{CLIENTS_VENV / 'bin'}:{os.environ['PATH']}",
        "HOME": str(tmp),
        "HF_HOME": str(tmp / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **env,
    }
    done = subprocess.run(
        [str(a) for a in args], env=environment, cwd=tmp, capture_output=True, text=True, timeout=timeout
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{args[0]} exited {done.returncode}:\n{output[-5000:]}"
    return output


def _next_token(path: Path, text: str, tokenizer) -> int:
    """The greedy token after ``text`` under the checkpoint at ``path``, by stock transformers."""
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    ids = tokenizer(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        return int(model(torch.tensor([ids])).logits[0, -1].argmax())


@pytest.fixture(scope="module")
def served(tmp_path_factory, shared_ray_address):
    """`expertmesh up --http-port 0` over a tiny Mixtral with a byte-level tokenizer and a chat template. The
    token the model predicts after the first item's last choice also ends a sequence (as EOS), so one of
    lm-eval's log-likelihood requests ends at the end-of-sequence token, as a real model's do after a
    complete answer."""
    for tool in ("lm_eval", "guidellm"):  # before the server starts: a missing venv fails at once
        _tool(tool)
    path = make_tiny_checkpoint(
        "mixtral",
        tmp_path_factory.mktemp("clients-ckpt") / "tiny",
        with_tokenizer=True,
        vocab_size=300,
        max_position_embeddings=CONTEXT,
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    item = CHOICE_ITEMS[0]
    ending = _next_token(path, f"{item['question']} {item['choices'][-1]}", tokenizer)
    ends = sorted({tokenizer.eos_token_id, ending})  # a list, as Llama 3's config has it
    for config in (AutoConfig.from_pretrained(path), GenerationConfig.from_pretrained(path)):
        config.eos_token_id = ends
        config.save_pretrained(path)
    with serving_http(path, shared_ray_address, tokenizer) as served:
        yield served


def _lm_eval(served, tmp: Path) -> dict[str, list[dict]]:
    """lm-eval's two tasks against the server: each task's logged samples."""
    tasks = tmp / "tasks"
    tasks.mkdir()
    for name, items in (("em_choice", CHOICE_ITEMS), ("em_generate", GENERATION_ITEMS)):
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(item) + "\n" for item in items))
        task = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            **TASKS[name],
        }
        (tasks / f"{name}.yaml").write_text(json.dumps(task, indent=2))
    model_args = {
        "model": served.model,
        "base_url": f"{served.url}/v1/completions",
        "tokenizer": served.path,
        "tokenizer_backend": "huggingface",
        "max_length": CONTEXT,
        "num_concurrent": 1,
        "max_retries": 1,  # a failing request fails the run, not retried into a pass
        "timeout": 120,
    }
    _run(
        [
            _tool("lm_eval"),
            "--model",
            "local-completions",
            "--model_args",
            ",".join(f"{k}={v}" for k, v in model_args.items()),
            "--batch_size",
            1,  # one prompt per request, all this server takes
            "--tasks",
            ",".join(TASKS),
            "--include_path",
            tasks,
            "--output_path",
            tmp / "results",
            "--log_samples",
        ],
        tmp,
    )
    samples = {}
    for name in TASKS:
        (logged,) = (tmp / "results").glob(f"*/samples_{name}_*.jsonl")
        samples[name] = [json.loads(line) for line in logged.read_text().splitlines()]
    return samples


def test_lm_eval_log_likelihoods_and_generations_equal_the_grpc_apis(served, tmp_path):
    samples = _lm_eval(served, tmp_path)
    tokenizer = served.tokenizer
    choices = samples["em_choice"]
    assert sorted(s["doc_id"] for s in choices) == list(range(len(CHOICE_ITEMS)))
    with Client(served.up.target, timeout=120) as client:
        for sample in choices:
            expected = []
            for (logged,), request in zip(sample["resps"], sample["arguments"].values(), strict=True):
                context, continuation = request["arg_0"], request["arg_1"]
                context_ids = tokenizer(context, add_special_tokens=False).input_ids
                ids = tokenizer(context + continuation, add_special_tokens=False).input_ids
                scores = client.score(ids).token_scores
                expected.append(sum(scores[len(context_ids) :]))
                assert float(logged[0]) == pytest.approx(expected[-1], abs=1e-4), (context, continuation)
            best = max(range(len(expected)), key=expected.__getitem__)
            assert sample["acc"] == float(best == sample["doc"]["answer"])
        for sample in samples["em_generate"]:
            (text,) = sample["resps"][0]
            ids = tokenizer(sample["arguments"]["gen_args_0"]["arg_0"], add_special_tokens=False).input_ids
            stop = ["\n", tokenizer.eos_token]  # lm-eval adds the EOS text to ``until``
            assert text == client.generate_text(ids, max_new_tokens=MAX_GEN_TOKS, stop=stop)


def test_one_of_lm_evals_requests_ends_at_eos(served):
    """The fixture's premise: the first item's last choice is followed by a token that ends the sequence, so
    lm-eval's one-token echo request for it finishes at EOS, whose log-probability must still be listed for
    lm-eval to read the continuation's right."""
    item = CHOICE_ITEMS[0]
    ids = served.tokenizer(f"{item['question']} {item['choices'][-1]}", add_special_tokens=False).input_ids
    with Client(served.up.target, timeout=120) as client:
        (chunk,) = client.generate(ids, max_new_tokens=1)
    assert chunk.finish_reason == "eos" and chunk.completion_tokens == 1


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_finishes_every_request(served, tmp_path, route):
    requests, prompt_tokens, output_tokens = 6, 16, 8
    report = tmp_path / "guidellm.json"
    _run(
        [
            _tool("guidellm"),
            "run",
            "--backend",
            f"kind=openai_http,target={served.url},model={served.model},request_format={route}",
            "--profile",
            "kind=constant,rate=8",  # requests overlap: the engine batches them
            "--constraint",
            f"kind=max_requests,count={requests}",
            "--data",
            f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--tokenizer",
            f"kind=hf_auto,model={served.path}",
            "--output",
            f"kind=json,path={report}",
            "--disable-console",
        ],
        tmp_path,
        GUIDELLM__MAX_WORKER_PROCESSES="1",  # its default of 10 spawned processes takes ~15 s to start on 2 cores
    )
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    # Every request guidellm reports succeeded. Its max_requests constraint stops queueing at the count and
    # processing once as many are processed; on a busy machine its report has been seen to leave out the last
    # one it created (total 5 of 6, none errored or incomplete), so the count may fall one short, no more.
    assert (totals["errored"], totals["incomplete"]) == (0, 0) and totals["successful"] == totals["total"], totals
    assert requests - 1 <= totals["successful"] <= requests, totals
    done = benchmark["requests"]["successful"]
    assert [r["output_metrics"]["text_tokens"] for r in done] == [output_tokens] * len(done)  # ignore_eos honoured
    assert all(r["input_metrics"]["text_tokens"] >= prompt_tokens for r in done)  # chat adds its template's tokens
