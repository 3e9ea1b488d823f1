"""`punica-x` command line.

`punica-x serve` loads the model and, until the HTTP frontend lands, runs a terminal chat
that streams tokens as they are generated (one demo question when stdin is not a terminal).
"""

from __future__ import annotations

import argparse
import sys


def _chat(args) -> int:
    from punica_x import LLM, SamplingParams

    llm = LLM(model=args.model)
    for name, path in args.adapter or []:
        llm.load_adapter(name, path)
    engine = llm.engine
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    interactive = sys.stdin.isatty()
    print(
        f"punica-x: serving {engine.loaded.name} on {engine.device}"
        + (" (type a message, Ctrl-D to quit)" if interactive else ""),
        flush=True,
    )
    history: list[dict] = []
    questions = (
        iter(lambda: input("> "), None) if interactive else iter(["What is the capital of France?"])
    )
    try:
        for question in questions:
            if not interactive:
                print(f"> {question}")
            history.append({"role": "user", "content": question})
            prompt = llm.tokenizer.apply_chat_template(
                history, add_generation_prompt=True, tokenize=False
            )
            reply = []

            def show(out, reply=reply):
                reply.append(out.new_text)
                print(out.new_text, end="", flush=True)

            engine.add_request(prompt, sp, args.lora, on_output=show)
            while engine.has_unfinished():
                engine.step()
            print()
            history.append({"role": "assistant", "content": "".join(reply)})
    except (EOFError, KeyboardInterrupt):
        print()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="punica-x", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the model (terminal chat for now)")
    serve.add_argument(
        "--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M)"
    )
    serve.add_argument(
        "--adapter",
        nargs=2,
        action="append",
        metavar=("NAME", "PATH"),
        help="load a PEFT adapter (repeatable)",
    )
    serve.add_argument("--lora", default=None, help="adapter to chat with (default: base model)")
    serve.add_argument("--max-tokens", type=int, default=256)
    serve.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _chat(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
