"""The `strata` command line. Engine flags are generated from EngineConfig's fields, so
every flag maps one to one onto a typed setting. Errors a user can fix print one line
and exit with status 2; nothing the user types produces a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from strata.config import EngineConfig
from strata.errors import StrataError

DESCRIPTION = """Strata: an OpenAI-compatible inference server for LLMs split by layers across
GPUs, with speculative drafts in every pipelined group."""
EXAMPLES = """examples:
  strata serve                                  # the embedded SmolLM2 on http://127.0.0.1:8000/v1
  strata serve --model ./Qwen3-0.6B --api-key-file key.txt
  strata generate "What is the capital of France?"
  strata bench --arm "drafts=--spec 8" --users 4
  strata calibrate --devices cpu,cpu,cpu,cpu --out p.json && strata serve --profile p.json

`strata COMMAND --help` lists a command's flags with their defaults."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help that ends each flag with its default, unless the help already says it or the
    flag has none; the description and epilog keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = (action.help or "").replace("%", "%%")  # config help is plain text
        default = action.default
        if ("default" in help or default is None or default is argparse.SUPPRESS
                or default is False or default == () or default == [] or not action.option_strings):
            return help
        shown = ",".join(map(str, default)) if isinstance(default, (tuple, list)) else default
        return f"{help} (default: {str(shown).replace('%', '%%')})"


def _list_of(kind):
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(part.strip()) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"'{text}' is not a comma-separated list of {kind.__name__} values") from None
    return parse


def add_config_flags(parser: argparse.ArgumentParser, cls, defaults: dict | None = None) -> None:
    """One flag per field of the frozen config dataclass `cls` (help from its metadata: plain
    text, so the parser formats help with HelpFormatter, which escapes its "%")."""
    if not issubclass(parser.formatter_class, HelpFormatter):
        parser.formatter_class = HelpFormatter
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.default)
        kind = f.metadata.get("list_of")
        if f.metadata.get("parse") is not None:
            parse = f.metadata["parse"]
        elif kind is not None:
            parse = _list_of(kind)
        elif f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=f.metadata["help"])
            continue
        else:
            parse = {"int": int, "int | None": int, "float": float, "float | None": float}.get(
                f.type, str)
        parser.add_argument(flag, type=parse, default=default, help=f.metadata["help"],
                            choices=f.metadata.get("choices"))


def add_engine_flags(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    add_config_flags(parser, EngineConfig, defaults)
    parser.add_argument("--device", dest="devices", type=_list_of(str), default=argparse.SUPPRESS,
                        help="alias of --devices")


def config_from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(EngineConfig, args)


def add_sampling_flags(parser: argparse.ArgumentParser, *, temperature: float) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=temperature,
                        help="sampling temperature, 0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the "
                        "most likely tokens up to this probability mass")
    parser.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens "
                        "(0 = off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely "
                        "than this fraction of the most likely one")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampling noise "
                        "(the same seed gives the same text)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace):
    from strata.sampling.params import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                          stop=tuple(args.stop))


def cmd_generate(args: argparse.Namespace) -> int:
    import time

    from strata.engine.engine import check_prompt, context_size
    from strata.llm import LLM, encode_prompt
    from strata.weights.checkpoint import open_checkpoint

    logging.basicConfig(level=logging.INFO, format="strata: %(message)s", stream=sys.stderr)
    config = engine_config(args)
    params = sampling_params(args)
    # NOTE: a prompt that cannot fit fails before the weights load
    checkpoint = open_checkpoint(config.model, config.mtp_model)
    tokenizer = checkpoint.load_tokenizer()
    prompt_ids = encode_prompt(tokenizer, args.prompt, raw=args.raw)
    check_prompt(prompt_ids, context_size(config, checkpoint.config), checkpoint.config.vocab_size)
    llm = LLM(config, checkpoint, tokenizer)
    try:
        start = time.perf_counter()
        for piece in llm.stream(prompt_ids, params):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        llm.close()
    if args.verbose:
        done = llm.last
        seconds = time.perf_counter() - start
        print(f"[{done.prompt_tokens} prompt tokens, {len(done.token_ids)} generated in "
              f"{seconds:.2f} s ({len(done.token_ids) / max(seconds, 1e-9):.1f} tok/s), "
              f"finish: {done.finish_reason}; {done.drafts.summary()}]", file=sys.stderr)
        for stage, stats in enumerate(llm.engine.expert_stats):
            if stats.hits or stats.misses:
                print(f"[stage {stage} experts: {stats.summary(len(done.token_ids))}]",
                      file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from strata.server.config import ServerConfig
    from strata.server.serve import serve

    return serve(engine_config(args), config_from_args(ServerConfig, args))


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        from strata.bench.config import bench_config
        from strata.bench.harness import run
    except ImportError as e:
        raise StrataError(f"strata bench needs {e.name}: pip install 'openai>=1.40' httpx "
                          "(the project's [bench] extra)") from None

    run(bench_config(args.arm, args.url, args.name, args.api_key, args.workloads,
                     edit_file=args.edit_file, users=args.users, turns=args.turns,
                     max_tokens=args.max_tokens, timeout=args.timeout,
                     start_timeout=args.start_timeout, out=args.out, record=args.record,
                     plot=args.plot, seed=args.seed, rounds=args.rounds,
                     interleave=args.interleave))
    return 0


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    from strata.bench.workloads import EDIT_FILES, TURNS, WORKLOADS

    parser.add_argument("--arm", action="append", default=[], metavar='NAME="FLAGS"',
                        help="a fresh `strata serve FLAGS` measured as NAME (repeatable)")
    parser.add_argument("--url", help="measure an existing OpenAI-compatible server, "
                        "e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--name", help="the --url arm's name (default: the URL)")
    parser.add_argument("--api-key", help="the --url server's API key")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, from {', '.join((*WORKLOADS, TURNS))}; "
                        f"{TURNS} (an agent's conversation re-sent every turn: first-token "
                        "time per turn, tokens from the prefix cache) runs only when named")
    parser.add_argument("--edit-file", default="small",
                        help=f"the edit and turns workloads' file: {', '.join(EDIT_FILES)}")
    parser.add_argument("--users", type=int, default=4,
                        help="concurrent requests of the N-users measurement (and "
                        "conversations of the turns workload)")
    parser.add_argument("--turns", type=int, default=4,
                        help="turns of each conversation of the turns workload")
    parser.add_argument("--max-tokens", type=int, default=900,
                        help="max_tokens of every request")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one request may take")
    parser.add_argument("--start-timeout", type=float, default=900.0,
                        help="seconds a started server may take to answer /health 200")
    parser.add_argument("--out", default="bench-results.json", help="raw results as JSON")
    parser.add_argument("--record", action="store_true",
                        help="append a summary line to benchmarks/results.jsonl")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the numbers (needs matplotlib)")
    parser.add_argument("--seed", type=int, help="keys the prompts' tags: every arm of a run "
                        "sends the same prompts, so arms compare on the same text (default: "
                        "drawn per run and printed; give it to repeat a run's prompts)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole protocol N times (fresh servers each round, arms "
                        "in a rotated order); each cell is the median round's, and a table "
                        "gives every cell's lowest and highest rate")
    parser.add_argument("--interleave", action="store_true",
                        help="start every arm's server at once and take the arms in turn for "
                        "each workload, so that a host whose speed drifts moves all arms "
                        "alike (needs the memory of all arms' servers together)")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from strata.calibrate.command import CalibrateOptions, calibrate, parse_acceptance

    logging.basicConfig(level=logging.WARNING, format="strata: %(message)s", stream=sys.stderr)
    acceptance = parse_acceptance(args.acceptance) if args.acceptance else None
    for name in ("users", "max_tokens", "repeats", "prompt_tokens", "output_tokens"):
        if getattr(args, name) < 1:
            raise StrataError(f"--{name.replace('_', '-')} must be at least 1")
    return calibrate(engine_config(args), CalibrateOptions(
        out=args.out, users=args.users, max_tokens=args.max_tokens, context=args.context,
        repeats=args.repeats, simulate=args.simulate, acceptance=acceptance,
        prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
        workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        show_all=args.all))


def add_calibrate_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="strata-profile.json",
                        help="the profile file to write")
    parser.add_argument("--users", type=int, default=4,
                        help="concurrent requests of the N-users prediction")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="tokens generated per sample prompt")
    parser.add_argument("--context", type=int, default=256,
                        help="tokens already in the slot when layers are timed")
    parser.add_argument("--repeats", type=int, default=5, help="timings per layer and width "
                        "(the median counts)")
    parser.add_argument("--simulate", metavar="PROFILE",
                        help="measure nothing: predict the table from this profile (its "
                        "settings are the defaults of the engine flags)")
    parser.add_argument("--acceptance", metavar="W=P,...",
                        help="with --simulate: synthetic requests per workload, each draft "
                        "token right with probability P, e.g. code=0.85,edit=0.98,prose=0.64")
    parser.add_argument("--all", action="store_true",
                        help="print every candidate's predicted row, not the best three")
    parser.add_argument("--workloads", default="code,edit,prose",
                        help="sample prompts to run: comma-separated, from code, edit, prose")
    parser.add_argument("--prompt-tokens", type=int, default=1024,
                        help="prompt length of the synthetic requests")
    parser.add_argument("--output-tokens", type=int, default=512,
                        help="output length of the synthetic requests")


def build_parser(profile: dict | None = None) -> argparse.ArgumentParser:
    """`profile`: engine settings that replace the flags' defaults (--profile)."""
    profile = profile or {}
    parser = argparse.ArgumentParser(prog="strata", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str):
        return sub.add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".",
                              formatter_class=HelpFormatter)

    gen = command("generate", "generate a reply to one prompt and stream it")
    gen.add_argument("prompt", help="the user message (or plain text with --raw)")
    gen.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    gen.add_argument("--verbose", action="store_true", help="print token counts and speed")
    add_sampling_flags(gen, temperature=0.0)
    add_engine_flags(gen, defaults=profile)
    gen.set_defaults(func=cmd_generate)

    from strata.server.config import ServerConfig
    srv = command("serve", "serve the OpenAI-compatible API over HTTP")
    add_config_flags(srv, ServerConfig)
    add_engine_flags(srv, defaults={"parallel": 4, **profile})
    srv.set_defaults(func=cmd_serve)

    cal = command("calibrate", "measure this machine's stages, choose --layer-split, "
                  "--batch-groups, --spec and --spec-pricing with the pipeline simulator, "
                  "and write them to a profile for `strata serve --profile`")
    add_calibrate_flags(cal)
    add_engine_flags(cal, defaults={"parallel": 4, **profile})
    cal.set_defaults(func=cmd_calibrate)

    bench = command("bench", "measure servers on the coding-agent workloads (1 user and N "
                    "users)")
    add_bench_flags(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    flag = "--simulate" if getattr(args, "simulate", None) else "--profile"
    source = getattr(args, flag[2:], None)
    if source is not None:  # its settings become the flags' defaults: given flags win
        from strata.calibrate.profile import load_profile
        try:
            settings = load_profile(source, flag).settings
        except StrataError as e:
            print(f"strata: error: {e}", file=sys.stderr)
            return 2
        args = build_parser(settings).parse_args(argv)
    if args.func in (cmd_serve, cmd_generate):
        from strata.pipeline.rendezvous import torchrun_address, torchrun_rank
        rank = torchrun_rank()
        if rank:  # torchrun started this process for a stage, not for the server
            from strata.pipeline.worker import stage_process_main
            address = torchrun_address()
            stage_process_main(address.host, address.port, address.world_size, rank)
            return 0
    try:
        return args.func(args)
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
