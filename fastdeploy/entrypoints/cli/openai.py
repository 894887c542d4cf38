"""``fastdeploy chat`` and ``fastdeploy complete``: talk to a running server (``vllm chat/complete``)."""

from __future__ import annotations

import argparse
from typing import Any

from fastdeploy import envs
from fastdeploy.entrypoints.cli.types import CLISubcommand


def _client(args: argparse.Namespace) -> tuple[Any, str]:
    """An OpenAI client for --url, and the model to use (--model-name, else the server's first model)."""
    from openai import OpenAI

    client = OpenAI(base_url=args.url, api_key=args.api_key or envs.openai_api_key("EMPTY"))
    if args.model_name:
        return client, args.model_name
    models = client.models.list()
    return client, models.data[0].id


def _read(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None


def _add_query_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", type=str, default="http://localhost:8000/v1",
                        help="URL of the running OpenAI-compatible server.")
    parser.add_argument("--model-name", type=str, default=None,
                        help="Model name in the requests (default: the first model in /v1/models).")
    parser.add_argument("--api-key", type=str, default=None,
                        help="API key (default: the OPENAI_API_KEY environment variable).")
    parser.add_argument("--max-tokens", type=int, default=None, help="Most tokens to generate per answer.")


def _print_stream(stream: Any, text_of: Any) -> str:
    """Print streamed chunks as they come; return the whole text."""
    parts = []
    for chunk in stream:
        if not chunk.choices:
            continue
        piece = text_of(chunk.choices[0]) or ""
        parts.append(piece)
        print(piece, end="", flush=True)
    print()
    return "".join(parts)


class _QueryCommand(CLISubcommand):
    """A sub-command that sends queries to a running server: one with -q, else a prompt loop."""

    help: str
    quick_metavar: str
    banner: str

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, help=self.help, usage=f"fastdeploy {self.name} [options]")
        _add_query_options(parser)
        parser.add_argument("-q", "--quick", type=str, metavar=self.quick_metavar, default=None,
                            help=f"Send one {self.quick_metavar.lower()}, print the answer and exit.")
        self.add_options(parser)
        return parser

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        """Options of this command beyond the common ones."""

    @classmethod
    def cmd(cls, args: argparse.Namespace) -> None:
        client, model = _client(args)
        ask = cls.make_query(client, model, args)
        if args.quick is not None:
            ask(args.quick)
            return
        print(cls.banner)
        while (text := _read("> ")) is not None:
            ask(text)

    @staticmethod
    def make_query(client: Any, model: str, args: argparse.Namespace) -> Any:
        raise NotImplementedError


class ChatCommand(_QueryCommand):
    """An interactive chat (or one question with -q) against a running server."""

    name = "chat"
    help = "Chat with a running API server."
    quick_metavar = "MESSAGE"
    banner = "Please enter a message for the chat model (Ctrl-D to quit):"

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--system-prompt", type=str, default=None, help="System prompt of the conversation.")

    @staticmethod
    def make_query(client: Any, model: str, args: argparse.Namespace) -> Any:
        conversation: list[dict[str, str]] = []
        if args.system_prompt is not None:
            conversation.append({"role": "system", "content": args.system_prompt})

        def ask(message: str) -> None:
            conversation.append({"role": "user", "content": message})
            stream = client.chat.completions.create(model=model, messages=conversation, stream=True,
                                                    max_tokens=args.max_tokens)
            answer = _print_stream(stream, lambda choice: choice.delta.content)
            conversation.append({"role": "assistant", "content": answer})

        return ask


class CompleteCommand(_QueryCommand):
    """Text completion of prompts (or one prompt with -q) against a running server."""

    name = "complete"
    help = "Complete prompts with a running API server."
    quick_metavar = "PROMPT"
    banner = "Please enter prompt to complete (Ctrl-D to quit):"

    @staticmethod
    def make_query(client: Any, model: str, args: argparse.Namespace) -> Any:
        def complete(prompt: str) -> None:
            stream = client.completions.create(model=model, prompt=prompt, stream=True, max_tokens=args.max_tokens)
            _print_stream(stream, lambda choice: choice.text)

        return complete
