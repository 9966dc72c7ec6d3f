"""The benchmark suites of bench/run.py, as data (one module per family, assembled here).

A suite is a dict:
  about     one line: what it measures and on what machine
  defaults  {name: value}: the values of the templates' {name}s unless a step's params or
            `--set name=...` give others
  servers   optional {name: command template}: servers the steps push to, each started on
            127.0.0.1 port 0 (the driver adds --listen and --port-file; its log is
            {out}/server_NAME.log); servers whose template has {metrics_flags} are scraped
            (their /metrics) before and after each step
  setup     optional list of {name, run, undo, when, env}: commands before the first step
            (`undo` after the last, also when the run fails); `when` names a value that must be
            true (`--set mps=1`); `env` is added to every command of the run while it is on
  parts     optional: the `part`s of steps that run unless `--set parts=a,b` names others
  lookups   optional {name: {"key": another value's name, "values": {its value: this one}}};
            a lookup does not replace a value given with --set
  steps     a list of steps, run in order

A step is a dict:
  kind      the step kind: report.py prints one table per kind
  run       the command template (a string: formatted, then split like a shell would)
  params    {name: [values]}: the step runs once per combination (the first name outermost);
            `bench/run.py SUITE --set name=v1,v2` replaces a list; a list given for a name that
            no step of the suite has repeats every step (e.g. --set round=1,2)
  parse     how its output becomes metrics (bench/suites/parsers.py): "json" (one JSON object),
            "json-rows:KEY" (one result per element of the object's KEY list), "transport"
            (fusedps-transport-bench's table), "result-line" (the examples' RESULT line),
            "train-log" (train_gpt.py --log-json), "dd", "checkpoint-log", "ncu", "probe",
            "wall" (the command's wall time over `reps`)
  reads     optional: a file (template) the parser reads instead of stdout; removed first
  servers   optional: the servers (names, templates over params) the step needs; {target} is
            the first one's address, {targets} all of them joined by commas
  fresh     optional: start the step's servers for each run and stop them after it (the default
            is one server per name for the whole suite)
  stop      optional: suite servers to stop before the step (e.g. to read their whole log)
  part      optional: the step runs only when its part is among the suite's `parts`
  alternate optional: the innermost param's order is reversed on every second combination of
            the others (rounds of A B, then B A: drift on a shared host hits both alike)
  parallel  optional (a number, or a template): runs of the step at once (no driver servers)
  background optional {run, parse, key, lead, when}: a command started `lead` seconds before
            the step's own and waited for after it; its parsed first row becomes the metric
            `key`; `when` is an expression over the values (e.g. "streams > 0")
  record    optional, False: run (e.g. to register a model) but record nothing but a failure
  size_of   optional ("wall"): a file whose size becomes the metric file_bytes
  derive    optional {metric: expression}: more metrics, computed from the params and metrics
  timeout   optional: seconds before the command is killed (default 600)

Templates name binaries as {bin:NAME} (a build's executable, or the pack's `run NAME`),
{python} ($FUSEDPS_PYTHON, else /usr/bin/python3 from a build, python3 from a pack), {out} (the
run's scratch folder), {certs} (the TLS test certificates, tests/integration/make_test_certs.sh)
and {corpus} (the GPT examples' text: the pack's jargon.txt.gz, else Debian's jargon-text).
Every other {name} is a param of the step, a default or a lookup of the suite; {{name}} is a
literal {name} (for tests/e2e/server_fixture.py). Servers that the whole suite shares are
formatted with the defaults alone; a step's `fresh` servers with the step's params. Every
command runs from the repository root with PYTHONPATH set to the build's (or the pack's) Python
package, and FUSEDPS_SERVER and FUSEDPS_CLI naming its server and CLI.
"""

from typing import Any, Dict

from . import kernel, server, training

SUITES: Dict[str, Dict[str, Any]] = {}
for _module in (kernel, server, training):
    SUITES.update(_module.SUITES)
