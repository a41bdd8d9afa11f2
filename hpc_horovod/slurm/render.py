"""Job scripts from a :class:`JobPlan` and the jinja2 templates of ``slurm_templates/``.

``base.sbatch.j2`` holds what every cluster needs; ``<cluster>.sbatch.j2`` extends it with the
site's habits. A site's own template (``--template FILE``, or a profile's ``template`` given as
a path) must ``{% extends "base.sbatch.j2" %}`` (or a cluster's template) and override its
blocks, so that the checked ``#SBATCH`` lines and the ``srun`` launch stay. Values reach the
script either validated (``#SBATCH`` lines) or through the ``shquote``/``shjoin`` filters
(commands), never raw.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import jinja2
import jinja2.nodes

from ..shipped import shipped_dir
from ..version import __version__
from .job import JobPlan, plan_job

SUFFIX = ".sbatch.j2"


def packaged_templates() -> list[str]:
    """The template names in ``slurm_templates/`` (``base``, ``generic``, ``jean-zay``, ...)."""
    return sorted(p.name[:-len(SUFFIX)] for p in shipped_dir("slurm_templates").glob(
        f"*{SUFFIX}"))


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(shipped_dir("slurm_templates"))),
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    env.filters["shquote"] = lambda value: shlex.quote(str(value))
    env.filters["shjoin"] = lambda values: shlex.join(str(v) for v in values)
    return env


def _site_template(env: jinja2.Environment, path: Path) -> jinja2.Template:
    """A site's template, checked: it parses and extends a packaged one (looked up among the
    packaged templates only, whatever lies next to it)."""
    source = path.read_text(encoding="utf-8")
    try:
        tree = env.parse(source, path.name, str(path))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"template {path}, line {exc.lineno}: {exc.message}") from None
    parents = [node.template.value for node in tree.find_all(jinja2.nodes.Extends)
               if isinstance(node.template, jinja2.nodes.Const)]
    packaged = [f"{name}{SUFFIX}" for name in packaged_templates()]
    if len(parents) != 1 or parents[0] not in packaged or parents[0] == path.name:
        raise ValueError(f"template {path} must start with {{% extends \"base{SUFFIX}\" %}} (or "
                         f"one of {', '.join(packaged)}) and override its blocks, so that the "
                         "checked #SBATCH lines and the srun launch stay; it extends "
                         f"{parents or 'nothing'}")
    return env.from_string(source)


def render_plan(plan: JobPlan) -> str:
    env = _environment()
    if plan.template in packaged_templates():
        template = env.get_template(f"{plan.template}{SUFFIX}")
    else:
        path = Path(plan.template).expanduser()
        if not path.is_file():
            raise ValueError(f"cluster {plan.cluster} names template {plan.template!r}, which "
                             f"is neither a packaged template ({', '.join(packaged_templates())})"
                             " nor a file")
        template = _site_template(env, path)
    try:
        return template.render(job=plan, version=__version__)
    except jinja2.TemplateError as exc:
        raise ValueError(f"template {plan.template}: {exc}") from None


def render_job(command, **options) -> str:
    """The job script for ``command`` (a list: ``["python", "train.py", ...]``), as text.

    Takes the options of :func:`hpc_horovod.slurm.job.plan_job` (``cluster``, ``nodes``,
    ``ntasks_per_node``, ``gpus_per_node``, ``time``, ``account``, ``qos``, ``partition`` or
    ``constraint``, ``job_name``, ``modules``, ``env``, ``requeue``, ``signal_seconds``,
    ``output``, ``template``, ...) and raises ``ValueError`` naming the fix before anything is
    produced.
    """
    return render_plan(plan_job(command, **options))
