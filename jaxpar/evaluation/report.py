"""lm-eval's evaluator run on a jaxpar model, and what comes out: its results JSON (in
the run directory's eval/, or --out), its table, and the speeds of scoring."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from unittest import mock

from tqdm import tqdm

from jaxpar.evaluation import BATCH_SIZE, sources
from jaxpar.evaluation.harness import JaxparLM
from jaxpar.evaluation.tasks import Tasks


def model(source: str, tokenizer, overrides: list[str], step=None, batch_size=BATCH_SIZE):
    """The backend on `source`'s model, placed as `jaxpar generate` places it."""
    loaded, text = sources.load(source, tokenizer, overrides, step)
    return JaxparLM(source=source, loaded=loaded, text=text, batch_size=batch_size)


def evaluate(
    lm: JaxparLM,
    tasks: Tasks,
    num_fewshot: int | None = None,
    limit: float | None = None,
    chat: bool = False,
) -> dict:
    """lm-eval's results of `tasks` on `lm` (its simple_evaluate: the task configs'
    few-shot counts unless `num_fewshot`, the first `limit` documents of each; with
    `chat`, each prompt through the tokenizer's chat template, few-shot examples as
    turns)."""
    import lm_eval
    import lm_eval.api.task

    # lm-eval's bar over a task's documents as it builds their prompts has no label
    # (lm_eval/api/task.py, Task.build_all_requests): it is named here
    named = functools.partial(tqdm, desc="building prompts", unit="doc")
    with mock.patch.object(lm_eval.api.task, "tqdm", named):
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks.objects),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=tasks.manager,
            log_samples=False,
            apply_chat_template=chat,
        )


def scores(results: dict) -> dict[str, float]:
    """Each task's metrics as flat names, `TASK/METRIC` (lm-eval's `acc,none` named by
    its filter only where it is not `none`): what metrics.jsonl and TensorBoard get."""
    out = {}
    for task, metrics in results["results"].items():
        known = results.get("higher_is_better", {}).get(task, {})  # the task's metrics
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if metric not in known or not isinstance(value, int | float):
                continue
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            out[f"{task}/{name}"] = float(value)
    return out


def write(results: dict, folder: Path) -> Path:
    """The results as lm-eval writes them, to folder/results_<time>.json."""
    from lm_eval.utils import handle_non_serializable

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"results_{time.strftime('%Y-%m-%dT%H-%M-%S')}.json"
    path.write_text(json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
    return path


def table(results: dict) -> str:
    """lm-eval's tables: the tasks, and the groups where there are any."""
    from lm_eval.utils import make_table

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text


def speeds(lm: JaxparLM) -> str:
    """One line: what scoring and generating took."""
    s = lm.speeds()
    parts = []
    if s["scored_tokens"]:
        parts.append(
            f"scored {s['scored_tokens']:,} tokens at {s['score_tokens_per_s']:,.0f} tokens/s "
            f"({s['score_buckets']} length buckets, compiled in {s['score_compile_s']:.1f} s)"
        )
    if s["generated_tokens"]:
        parts.append(
            f"generated {s['generated_tokens']:,} tokens at {s['generate_tokens_per_s']:,.0f} "
            f"tokens/s ({s['generate_buckets']} buckets)"
        )
    layout = " x ".join(f"{k}={v}" for k, v in lm.m.mesh.shape.items() if k in ("data", "tensor"))
    return f"{'; '.join(parts) or 'nothing scored'}; layout {layout}"
