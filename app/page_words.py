"""refpar's sentences said with a page's own controls: the command line's checks (refpar.engine.validate,
refpar.schedules.builders, ...) name flags, which no page has. Each page gives its flags' labels; a
sentence keeps its numbers and its reason, and names the box or choice to change instead."""

import re


def in_page_words(sentence: str, controls: dict[str, str]) -> str:
    """`sentence` with each `--flag` of `controls` (flag without its dashes -> the page's label) said as
    that control: "use --microbatches 8 or more" -> "set m (microbatches) to 8 or more"."""
    for flag, label in controls.items():
        sentence = re.sub(rf"\b(?:use|give) --{flag} (\S+)", lambda m, label=label: f"set {label} to {m[1]}",
                          sentence)
        sentence = re.sub(rf"--{flag}\b", lambda m, label=label: label, sentence)
    return sentence
