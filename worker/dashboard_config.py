"""rq-dashboard's config module for pagedq: ``rq-dashboard --json --disable-delete --config
worker.dashboard_config`` (the compose service's command; rq-dashboard imports it before it
registers its blueprint, and this file needs only rq-dashboard, so the dashboard image copies it
alone).

The RQ mirror is a view; the job streams are the source of truth. rq-dashboard's requeue
buttons would move a pagedq job's record back to "queued" where no pagedq worker ever looks (the
record would lie forever, and the job would not run again), and its delete and empty buttons
would remove records of jobs that still run (the worker's next transition then leaves a partial
record behind). ``--disable-delete`` turns off delete and empty; this module refuses requeue
(one job, and "requeue all", which also answers GET) with 403 and hides the requeue buttons.
Resubmit a job with the producer instead (``pagedq submit``, ``Client.submit``).
"""

from flask import Response, jsonify, request
from rq_dashboard.web import blueprint

REFUSED = {"rq_dashboard.requeue_job_view", "rq_dashboard.requeue_all",
           "rq_dashboard.delete_job_view", "rq_dashboard.empty_queue"}
MESSAGE = ("refused by pagedq: the RQ records mirror pagedq's job streams; requeue or delete "
           "would make them lie. Resubmit with the pagedq producer.")
HIDE = (b"<style>#requeue-all-btn, #requeue-job-btn, [data-role=requeue-job-btn]"
        b" { display: none !important; }</style></head>")


@blueprint.before_request
def refuse_requeue_and_delete() -> tuple[Response, int] | None:
    if request.endpoint in REFUSED:
        return jsonify(status="DISABLED", message=MESSAGE), 403
    return None


@blueprint.after_request
def hide_requeue_buttons(response: Response) -> Response:
    if response.mimetype == "text/html" and not response.direct_passthrough:
        response.set_data(response.get_data().replace(b"</head>", HIDE, 1))
    return response
