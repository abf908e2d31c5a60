"""The MLflow proxy's viewer rule, judged on what a request does (issue 19, item 6).

A viewer's GraphQL may ask only for the root fields of the MLflow UI's read-only queries;
``mlflowListArtifacts`` is refused however it is spelt (alias, fragment, inline fragment,
a second operation, a mutation). The real queries below are copied from MLflow 3.17.2's UI
bundle (``mlflow/server/js/build/static/js``), trimmed.
"""

import json

import pytest

from gpuhub_spawner.mlflow.proxy import viewer_graphql_refusal, viewer_refusal

UI_GET_RUN = """query GetRun($data: MlflowGetRunInput!) @component(name: "MLflow.ExperimentRunTracking") {
    mlflowGetRun(input: $data) { apiError { code message } run { info { runUuid artifactUri }
      data { metrics { key value } } modelVersions { name source } } } }"""
UI_SEARCH_RUNS = (
    "query SearchRuns($data: MlflowSearchRunsInput!) { mlflowSearchRuns(input: $data) { runs { info { runUuid } } } }"
)
UI_BULK = """query GetMetricHistoryBulkInterval($data: MlflowGetMetricHistoryBulkIntervalInput!)
  @component(name: "MLflow.ExperimentRunTracking") { mlflowGetMetricHistoryBulkInterval(input: $data) {
    __typename metrics { step value } } }"""
UI_EXPERIMENT = (
    "query MlflowGetExperimentQuery($input: MlflowGetExperimentInput!) "
    '@component(name: "MLflow.ExperimentRunTracking") { mlflowGetExperiment(input: $input) { experiment { name } } }'
)

LIST = 'mlflowListArtifacts(input: {runId: "r1"}) { files { path } }'


def body(query, **extra) -> bytes:
    return json.dumps({"query": query, **extra}).encode()


@pytest.mark.parametrize("query", [UI_GET_RUN, UI_SEARCH_RUNS, UI_BULK, UI_EXPERIMENT, "{ __typename }"])
def test_the_uis_read_only_queries_pass(query):
    assert viewer_graphql_refusal(body(query, variables={"data": {"runId": "r1"}})) is None


@pytest.mark.parametrize(
    "query",
    [
        "{ " + LIST + " }",
        "query { " + LIST + " }",
        'query { run: mlflowGetRun(input: {runId: "r1"}) { run { info { runUuid } } } files: ' + LIST + " }",
        "query { mine: " + LIST + " }",  # an alias of an allowed name does not help
        "query { ... on Query { " + LIST + " } }",
        "query { ...F } fragment F on Query { " + LIST + " }",
        "query { ...F } fragment F on Query { ...G } fragment G on Query { " + LIST + " }",
        "query { ...F } fragment F on Query { ...F }",  # a cycle (MLflow refuses it too) with nothing allowed
        "query { ...Missing }",
        # operationName picks the harmless one; the other is in the same document: refused.
        'query A { mlflowGetRun(input: {runId: "r1"}) { run { info { runUuid } } } } query B { ' + LIST + " }",
        'mutation { mlflowSearchRuns(input: {experimentIds: ["1"]}) { runs { info { runUuid } } } }',
        'mutation { mlflowSearchDatasets(input: {experimentIds: ["1"]}) { datasets { name } } }',
        'subscription { mlflowGetRun(input: {runId: "r1"}) { run { info { runUuid } } } }',
        '{ mlflowSearchModelVersions(input: {filter: ""}) { modelVersions { source } } }',
        "{ __schema { types { name } } }",
        '{ test(inputString: "x") { output } }',
        "type Query { x: Int }",  # not an executable definition
        '{ mlflowGetRun(input: {runId: "r1"}) ',  # does not parse
    ],
)
def test_anything_else_is_refused(query):
    assert viewer_graphql_refusal(body(query, operationName="A")) is not None


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"[]",
        json.dumps([{"query": UI_GET_RUN}]).encode(),  # a batch
        json.dumps({"variables": {}}).encode(),  # no query (a persisted-query hash)
        json.dumps({"query": 1}).encode(),
        # Two readers of duplicate keys could pick different queries: refused.
        b'{"query": "' + UI_SEARCH_RUNS.encode() + b'", "query": "{ ' + LIST.replace('"', '\\"').encode() + b' }"}',
    ],
)
def test_malformed_requests_are_refused(raw):
    assert viewer_graphql_refusal(raw) is not None


def test_a_huge_query_is_refused_without_parsing_it_all():
    query = "{ " + " ".join(f"a{i}: __typename" for i in range(20_000)) + " }"
    assert "does not parse" in viewer_graphql_refusal(body(query))


@pytest.mark.parametrize(
    ("rel", "method", "query", "allowed"),
    [
        ("api/2.0/mlflow/runs/get", "GET", "run_id=1", True),
        ("api/2.0/mlflow/runs/search", "POST", "", True),
        ("api/2.0/mlflow/runs/search", "DELETE", "", False),  # a search path is a read only as a POST
        ("api/2.0/mlflow/runs/delete", "POST", "", False),
        ("api/2.0/mlflow/artifacts/list", "GET", "run_id=1", False),
        ("api/2.0/mlflow-artifacts/artifacts/1/r/artifacts/w.txt", "GET", "", False),
        ("graphql", "POST", "", True),  # then judged on its body
        ("graphql", "GET", "", False),
        ("graphql", "GET", "query=%7B__typename%7D", False),
        ("graphql", "HEAD", "", False),
        ("graphql", "POST", "query=%7B__typename%7D", False),
        ("graphql/", "POST", "x=1", False),
    ],
)
def test_the_viewer_rule_is_about_what_a_request_does(rel, method, query, allowed):
    assert (viewer_refusal(rel, method, query) is None) is allowed
