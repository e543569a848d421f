"""RAG over this repository's README.md against `tokenway serve`: the README is chunked and
embedded into a sqlite-vec file, the passages nearest a question are retrieved and assembled
into the window as marked untrusted data (tokenway.client.assemble, untrusted), and the chat
model answers from them.

    tokenway serve &
    python examples/rag_readme.py "How do I create an API key?" [--url http://127.0.0.1:8000]
                                  [--k 4] [--db .cache/rag_readme.db] [--file README.md]

The index stays in --db: a second run embeds nothing while the file is unchanged (each chunk
keeps its document's hash). --url defaults to $TOKENWAY_URL, else http://127.0.0.1:8000.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import openai

from tokenway.client.assemble import assemble
from tokenway.client.counting import RemoteCounter
from tokenway.client.retrieval import Retriever
from tokenway.client.untrusted import Spotlight
from tokenway.client.vectors import SqliteVecStore

REPO = Path(__file__).resolve().parents[1]
SYSTEM = "Answer the question from the retrieved passages. Say which source you used. If they do not say, say so."


def main(args: argparse.Namespace) -> int:
    client = openai.OpenAI(base_url=f"{args.url.rstrip('/').removesuffix('/v1')}/v1", api_key="unused", timeout=300)
    Path(args.db).parent.mkdir(parents=True, exist_ok=True)
    with SqliteVecStore(args.db) as store:
        index = Retriever(client, store)
        path = Path(args.file)
        report = index.add(path.read_text(encoding="utf-8"), source=path.name)
        if report.num_unchanged:
            print(f"index: {args.file} unchanged in {args.db}; nothing embedded")
        else:
            print(f"index: {args.file} -> {report.num_chunks} chunks, {report.num_tokens} tokens embedded")
        passages = index.search(args.question, k=args.k)
    print("sources:")
    for number, passage in enumerate(passages, 1):
        print(f"  [{number}] {passage.citation}  score {passage.score:.2f}")
    window = client.models.retrieve(args.model).model_extra["max_model_len"]
    request = {"model": args.model, "messages": [{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": args.question}], "temperature": 0}
    request, assembled = assemble(request, RemoteCounter(client), window=window, max_tokens=args.max_tokens,
                                  passages=passages, spotlight=Spotlight())
    print(f"context: {len(assembled.passages_kept)} passages kept, {len(assembled.passages_dropped)} dropped, "
          f"{assembled.prompt_tokens} prompt tokens of {assembled.budget}")
    for flagged in assembled.flagged:
        print(f"  flagged: {flagged.source} looked like instructions ({', '.join(flagged.categories)})")
    reply = client.chat.completions.create(**request)
    print("answer:")
    print(reply.choices[0].message.content.strip())
    print(f"[{reply.usage.prompt_tokens} prompt tokens, {reply.usage.completion_tokens} completion tokens]")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question")
    parser.add_argument("--url", default=os.environ.get("TOKENWAY_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--file", default=str(REPO / "README.md"))
    parser.add_argument("--db", default=str(REPO / ".cache" / "rag_readme.db"))
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=128)
    sys.exit(main(parser.parse_args()))
