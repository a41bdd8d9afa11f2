"""Job scripts from a :class:`JobPlan` and the jinja2 templates in ``templates/``.

``base.sbatch.j2`` holds what every cluster needs; ``<cluster>.sbatch.j2`` extends it with the
site's habits. A profile's ``template`` may also be the path of a user template (it
``{% extends "base.sbatch.j2" %}`` too). Values reach the script either validated (``#SBATCH``
lines) or through the ``shquote``/``shjoin`` filters (commands), never raw.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import jinja2

from ..version import __version__
from .job import JobPlan, plan_job


def _environment(template: str) -> tuple[jinja2.Environment, str]:
    loaders: list[jinja2.BaseLoader] = [jinja2.PackageLoader("hpc_horovod.slurm", "templates")]
    name = f"{template}.sbatch.j2"
    if "/" in template or template.endswith(".j2"):
        path = Path(template).expanduser()
        if not path.is_file():
            raise ValueError(f"job script template {path} does not exist")
        loaders.insert(0, jinja2.FileSystemLoader(str(path.parent)))
        name = path.name
    env = jinja2.Environment(loader=jinja2.ChoiceLoader(loaders), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             autoescape=False)
    env.filters["shquote"] = lambda value: shlex.quote(str(value))
    env.filters["shjoin"] = lambda values: shlex.join(str(v) for v in values)
    return env, name


def render_plan(plan: JobPlan) -> str:
    env, name = _environment(plan.template)
    try:
        template = env.get_template(name)
    except jinja2.TemplateNotFound:
        raise ValueError(f"cluster {plan.cluster} names template {plan.template!r}, which is "
                         "neither a packaged template nor a file") from None
    return template.render(job=plan, version=__version__)


def render_job(command, **options) -> str:
    """The job script for ``command`` (a list: ``["python", "train.py", ...]``), as text.

    Takes the options of :func:`hpc_horovod.slurm.job.plan_job` (``cluster``, ``nodes``,
    ``gpus_per_node``, ``time``, ``account``, ``qos``, ``partition`` or ``constraint``,
    ``job_name``, ``modules``, ``env``, ``requeue``, ``signal_seconds``, ``output``, ...) and
    raises ``ValueError`` naming the fix before anything is produced.
    """
    return render_plan(plan_job(command, **options))
