"""`gencli qa QUESTION... --context TEXT`: extractive question answering with a BERT-family span head."""

from __future__ import annotations

from typing import Annotated, Optional

from gencli.cli import app
from gencli.cli.common import DETERMINISTIC_SEED_HELP, RunOptions, command, option
from gencli.cli.embed import TextsArg, TextsFileOpt, read_texts

DEFAULT_MODEL = "bert-shapes-qa"  # the embedded default: questions about a shapes-world caption


@command(app, "qa", seed_help=DETERMINISTIC_SEED_HELP)
def qa(
    questions: TextsArg = None,
    texts_file: TextsFileOpt = None,
    context: Annotated[Optional[str], option("--context", help="The text the answers are cut from.")] = None,
    context_file: Annotated[Optional[str], option("--context-file", metavar="FILE", help="Read the context from FILE (- = stdin).")] = None,
    top_k: Annotated[int, option("--top-k", help="Answers per question, best first.")] = 1,
    max_answer_length: Annotated[int, option("--max-answer-length", help="The longest answer, in tokens.")] = 15,
    max_length: Annotated[
        Optional[int], option("--max-length", help="Tokens per window: question + context (default: the model's window, at most 384).")
    ] = None,
    stride: Annotated[
        Optional[int], option("--stride", help="Context tokens shared by consecutive windows of a long context (default: half a window, at most 128).")
    ] = None,
    *,
    opts: RunOptions,
) -> None:
    """Answer questions with a span of the context, using a BERT, RoBERTa or DistilBERT question-answering model.

    The span transformers' question-answering pipeline picks (score = p_start x p_end, widened to whole
    words); a context longer than one window is read in overlapping windows. With --json one line per
    answer: {"question", "answer", "score", "start", "end"}, start and end being character offsets into
    the context. Without --model: bert-shapes-qa, which answers questions about a shapes-world caption
    (reliable on captions of one object only; a demonstration).
    """
    from gencli.errors import UserError
    from gencli.io import check_text, read_text
    from gencli.weights import resolve_model

    if (context is None) == (context_file is None):
        raise UserError("give the context with exactly one of --context TEXT and --context-file FILE")
    if context_file is not None:
        context = read_text(context_file, what="--context-file")[0]
    assert context is not None
    check_text(context, "--context")
    if not context.strip():
        raise UserError("the context is empty")
    if context_file == "-" and (questions and "-" in questions or texts_file == "-"):
        raise UserError("stdin ('-') can be read only once")
    question_list = read_texts(questions, texts_file)
    for i, q in enumerate(question_list):
        if not q.strip():
            raise UserError(f"question {i + 1} is empty")
    from gencli.console import emit_json
    from gencli.pipelines.encoders.loading import load_encoder
    from gencli.pipelines.encoders.qa import answer

    report = opts.report
    enc = load_encoder(resolve_model(opts.model, DEFAULT_MODEL), task="question_answering", **opts.load_options())
    report.debug(f"qa: {enc.describe()}")
    results = [answer(enc, q, context, top_k=top_k, max_answer_length=max_answer_length, max_length=max_length, stride=stride) for q in question_list]
    with opts.results() as fh:
        for q, answers in zip(question_list, results):
            for a in answers:
                if report.json:
                    emit_json({"question": q, **a}, fh)
                else:
                    fh.write(f"{a['score']:.4f}  {a['answer']!r}  ({a['start']}-{a['end']})  {q}\n")
            if not answers and not report.json:
                fh.write(f"(no answer)  {q}\n")
