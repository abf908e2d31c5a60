"""The MLflow proxy's ownership rewrite of a run's tags, on bodies whose ``tags`` is not a list.

Found by the type checker (issue 45): ``{"tags": 5}`` (or ``true``) on ``runs/create`` or
``runs/log-batch`` raised a TypeError in the proxy, a 500 and a traceback in the hub's log,
where any other malformed ``tags`` value was handled. Now: on create, a ``tags`` value that is
not a list holds no tag and the run gets only its owner's (as a string or an object always
did); on log-batch, a body without a list of tags has no owner tag to rewrite and goes to
MLflow as sent (MLflow judges it).
"""

import json

import pytest

from gpuhub_spawner.mlflow.proxy import rewrite_request

CREATE = "api/2.0/mlflow/runs/create"
LOG_BATCH = "api/2.0/mlflow/runs/log-batch"


@pytest.mark.parametrize("tags", [5, True, 2.5, "abc", {"key": "mlflow.user"}, None])
def test_create_with_tags_not_a_list_gets_only_the_owners_tag(tags):
    out = json.loads(rewrite_request(CREATE, "POST", json.dumps({"experiment_id": "1", "tags": tags}).encode(), "alice"))
    assert out["tags"] == [{"key": "mlflow.user", "value": "alice"}]
    assert out["user_id"] == "alice"


@pytest.mark.parametrize("tags", [5, True, 2.5])
def test_log_batch_with_tags_not_a_list_goes_as_sent(tags):
    sent = {"run_id": "r", "tags": tags}
    assert json.loads(rewrite_request(LOG_BATCH, "POST", json.dumps(sent).encode(), "alice")) == sent
