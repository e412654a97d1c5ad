"""The tokenizer of the model a server serves, for runs given no ``--tokenizer``.

Random prompts are drawn from the model's vocabulary and text prompts are counted with
its tokenizer, so a run needs the served model's tokenizer. The server names its model
(pdserve's ``GetModelInfo``, OpenAI's ``GET /v1/models``); that name is a local folder
when the server was started on one (``vllm serve /path/to/model``), or the name of a
model ``pdserve model prepare`` wrote (pdserve serves a model under its folder's name).
Anything else (a hub id, a renamed model) has no local tokenizer to find, and the user
has to name the folder.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import grpc

from services.bench.targets import GrpcTarget, OpenAITarget, Target
from services.engine.model import models_dir

# What Hugging Face's AutoTokenizer reads a tokenizer from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def tokenizer_folder(model: str) -> Path:
    """The folder holding the tokenizer of the model named ``model``, as a local folder
    or as a prepared pdserve model; ValueError, saying what to pass, when neither."""
    candidates = [Path(model).expanduser()] if model else []
    if model and "/" not in model:
        candidates.append(models_dir() / model)
    for folder in candidates:
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            return folder
    raise ValueError(
        f"the server serves model {model!r}, which is neither a local model folder nor a "
        "model prepared by `pdserve model prepare`, so its tokenizer is not here: pass "
        "--tokenizer MODEL_DIR (a local folder with the model's tokenizer), or "
        "--vocab-size N for random token-id prompts"
    )


async def served_tokenizer(target: Target) -> tuple[str, Path]:
    """Asks the server which model it serves; that name and the model's tokenizer."""
    try:
        await target.start()
        model = await target.served_model()
    except (aiohttp.ClientError, grpc.aio.AioRpcError, OSError) as exc:
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else exc
        raise ValueError(
            f"cannot ask the server which model it serves ({detail}): start it first, or "
            "pass --tokenizer MODEL_DIR"
        ) from None
    finally:
        await target.close()
    return model, tokenizer_folder(model)


async def served_max_model_len(target: GrpcTarget | OpenAITarget) -> int:
    """The served model's context length, as the server states it; ValueError, saying
    what to pass, when it cannot be asked or does not say."""
    try:
        await target.start()
        await target.served_model()
        length = await target.served_max_model_len()
    except (aiohttp.ClientError, grpc.aio.AioRpcError, OSError) as exc:
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else exc
        raise ValueError(f"cannot ask the server for its model's context length ({detail}): "
                         "start it first, or pass --max-model-len N") from None
    finally:
        await target.close()
    if not length:
        raise ValueError("the server does not state its model's context length: pass "
                         "--max-model-len N")
    return length
