"""One worker URL, one server (issue 32 item 2): fleet.yaml refuses two servers naming one
``router_url`` behind one router (however it is written), naming both entries; the plan-time check
refuses what ``--data`` overrides make of the inventory; the router's preflight refuses a leave when
the worker URL answers as another server than the one the container's observe saw (a fake server
stands for what answers there)."""

from __future__ import annotations

import json
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpugate import router
from gpugate.claims import routes_of_inventory, shared_worker_urls
from gpugate.router.smg import worker_url_key
from gpugate.fleet import FleetError, fleet_to_inventory, load_fleet
from gpugate.spec import Routing

FLEET = """
routers:
  gw: {url: "http://10.0.0.1:30080"}
  gw2: {url: "http://10.0.0.2:30080"}
hosts:
  pve1:
    containers:
      129:
        sglang: {model_path: /m, port: 30000, router: gw, router_url: "http://10.0.0.5:30000"}
  pve2:
    containers:
      130:
        sglang:
          - {model_path: /m, port: 30000, router: gw, router_url: "http://10.0.0.6:30000"}
          - {model_path: /m, port: 30001, router: gw, router_url: "URL130B"}
"""


def write(tmp_path, text: str):
    path = tmp_path / "fleet.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("written", [
    "http://10.0.0.5:30000",      # a copy-paste slip
    "http://10.0.0.5:30000/",     # a trailing slash
])
def test_two_servers_naming_one_worker_url_are_refused_naming_both(tmp_path, written):
    path = write(tmp_path, FLEET.replace("URL130B", written))
    with pytest.raises(FleetError) as caught:
        load_fleet(path)
    error = caught.value
    assert error.entry == "hosts.pve2.containers.130.sglang[1].router_url", error
    assert "is also the router_url of hosts.pve1.containers.129.sglang behind router gw" in error.problem, error
    assert "give each server the URL the router reaches it at" in error.problem, error
    assert str(error).startswith(f"{path}: hosts.pve2.containers.130.sglang[1].router_url: http://10.0.0.5:30000 ")


def test_the_default_port_and_the_hosts_case_are_one_url(tmp_path):
    text = (FLEET.replace('"http://10.0.0.5:30000"', '"http://Node-5.example"')
            .replace("URL130B", "http://node-5.example:80/"))
    with pytest.raises(FleetError, match=r"sglang\[1\]\.router_url: http://node-5.example:80 is also the router_url "
                                         r"of hosts\.pve1\.containers\.129\.sglang"):
        load_fleet(write(tmp_path, text))


def test_two_router_names_for_one_router_url_are_one_router(tmp_path):
    text = (FLEET.replace('gw2: {url: "http://10.0.0.2:30080"}', 'gw2: {url: "http://10.0.0.1:30080/"}')
            .replace("router: gw, router_url: \"URL130B\"", "router: gw2, router_url: \"http://10.0.0.5:30000\""))
    with pytest.raises(FleetError, match=r"behind router gw2 \(router gw's URL too\)"):
        load_fleet(write(tmp_path, text))


def test_one_url_behind_two_routers_or_two_ports_of_one_host_are_accepted(tmp_path):
    text = FLEET.replace("router: gw, router_url: \"URL130B\"", "router: gw2, router_url: \"http://10.0.0.5:30000\"")
    load_fleet(write(tmp_path, text))
    load_fleet(write(tmp_path, FLEET.replace("URL130B", "http://10.0.0.5:30001")))


def test_a_data_override_that_makes_one_url_of_two_is_refused_at_plan_time(tmp_path):
    """``--data sglang_router_url=`` applies to every host of the inventory: the plan-time check
    (sglang.server, before anything is observed) reads the inventory with it, whatever ``--limit``."""
    text = FLEET.replace("""        sglang:
          - {model_path: /m, port: 30000, router: gw, router_url: "http://10.0.0.6:30000"}
          - {model_path: /m, port: 30001, router: gw, router_url: "URL130B"}""",
                         """        sglang: {model_path: /m, port: 30000, router: gw, router_url: "http://10.0.0.6:30000"}
      131:
        sglang: {model_path: /m, port: 30000}""")
    groups = fleet_to_inventory(load_fleet(write(tmp_path, text)))
    hosts = [member for name, (members, _data) in groups.items() if name.startswith("pve_") for member in members]
    assert shared_worker_urls(routes_of_inventory(hosts)) == []
    override = [(name, {**data, "sglang_router_url": "http://10.0.0.9:30000/", "only_port": 30000})
                for name, data in hosts]
    # 131 names no router: the URL alone does not route it
    assert shared_worker_urls(routes_of_inventory(override)) == [
        "@pct/pve1:129 :30000 and @pct/pve2:130 :30000 both name worker URL http://10.0.0.9:30000 behind router gw"]


def test_worker_url_key_normalises_how_a_url_is_written_not_where_it_points():
    assert worker_url_key("https://A.example/") == worker_url_key("https://a.example:443")
    assert worker_url_key("http://a.example:8080") != worker_url_key("http://a.example")
    assert worker_url_key("http://localhost:1") != worker_url_key("http://127.0.0.1:1")  # the identity check's case


# ---------------------------------------------------------------- what answers at the worker URL


class FakeInfo:
    """An info endpoint at a real port: ``/get_server_info`` answers ``doc`` (404 when None), or
    ``pages`` (path -> text) answer as a server of another engine would."""

    def __init__(self, doc=None, status=200, pages=None):
        self.doc, self.status, self.paths = doc, status, []
        self.pages = pages if pages is not None else ({"/get_server_info": json.dumps(doc)} if doc is not None else {})
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                fake.paths.append(self.path)
                if self.path not in fake.pages:
                    self.send_response(404)
                    self.end_headers()
                    return
                body = fake.pages[self.path].encode()
                self.send_response(fake.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    servers = []

    def make(doc=None, status=200, pages=None):
        servers.append(FakeInfo(doc, status, pages))
        return servers[-1]
    yield make
    for server in servers:
        server.close()


THIS = {"model_path": "/opt/models/m", "port": 30000, "tp_size": 2, "random_seed": 811, "max_total_num_tokens": 9000}
SERVING = {"health": {"health": 200}, "server_info": {"path": "/get_server_info", "error": None, "args": THIS}}


class Workers:
    """The SmgClient surface for the preflight: smg lists ``url`` and a healthy peer."""

    def __init__(self, url):
        self.list = [{"id": "w1", "url": url, "model_id": "m", "is_healthy": True, "status": "ready"},
                     {"id": "w2", "url": "http://10.9.9.9:1", "model_id": "m", "is_healthy": True, "status": "ready"}]

    def workers(self):
        return [dict(w) for w in self.list]


def check(url, observed):
    routing = Routing("gw", "http://gw:1", url)
    return router.preflight(routing, Workers(url), observed=observed)


def test_the_worker_url_that_answers_as_this_server_may_leave(fake):
    # the whole document answers, extra keys and the dynamic parts included
    url = fake({**THIS, "host": "0.0.0.0", "internal_states": [{"load": 3}]}).url
    pre = check(url, SERVING)
    assert pre.problem is None and pre.worker["id"] == "w1", pre


def test_another_replica_of_the_same_flags_is_told_by_what_it_drew_itself(fake):
    """Same model, port and flags (two containers of one fleet): only the per-process seed differs."""
    url = fake({**THIS, "random_seed": 5}).url
    pre = check(url, SERVING)
    assert pre.kind == "not-this-server", pre
    assert f"lists worker w1 at {url}, but {url}/get_server_info answers as a server of model_path " \
           f'"/opt/models/m", port 30000 that is not this server: random_seed 5 (this server: 811)' in pre.problem
    assert "fix this server's router_url" in pre.problem


def test_another_model_or_port_is_named(fake):
    url = fake({**THIS, "model_path": "/opt/models/other", "port": 30001}).url
    problem = check(url, SERVING).problem
    assert 'model_path "/opt/models/other" (this server: "/opt/models/m")' in problem
    assert "port 30001 (this server: 30000)" in problem


def test_a_worker_url_that_does_not_answer_while_this_server_serves_is_refused(fake):
    server = fake(THIS)
    url = server.url
    server.close()
    pre = check(url, SERVING)
    assert pre.kind == "not-this-server" and f"{url} does not answer" in pre.problem, pre


def test_a_worker_url_that_answers_while_this_server_does_not_is_another_server(fake):
    url = fake(THIS).url
    down = {"health": {"health": None}, "server_info": None}
    pre = check(url, down)
    assert pre.kind == "not-this-server" and "while this server does not serve there" in pre.problem, pre
    # neither answers: the URL may be this server's, down with it (a restart is what it needs)
    assert check(fake(None).url, down).problem is None


def test_a_server_that_asks_for_a_key_cannot_be_told_and_is_not_refused(fake):
    url = fake({"error": "unauthorized"}, status=401).url
    assert check(url, SERVING).problem is None


def test_without_an_observed_server_the_preflight_is_as_before(fake):
    url = fake({**THIS, "random_seed": 5}).url
    assert router.preflight(Routing("gw", "http://gw:1", url), Workers(url)).problem is None


def vllm_pages(root: str) -> dict:
    """What a vLLM server answers where its engine reads its info (/v1/models, /version, /metrics)."""
    return {"/v1/models": json.dumps({"object": "list", "data": [{"id": "m", "root": root, "max_model_len": 4096}]}),
            "/version": json.dumps({"version": "0.33.0"}),
            "/metrics": 'vllm:cache_config_info{block_size="16",num_gpu_blocks="512"} 1.0\n'}


def test_a_vllm_worker_url_is_told_by_vllms_own_info_pages(fake):
    from gpugate.engine import get as engine_named
    pages = vllm_pages("/opt/models/m")
    observed = {"server_info": engine_named("vllm").read_info(lambda path: (200, pages[path]))}
    assert observed["server_info"]["args"]["kv_cache_tokens"] == 8192, observed
    routing = Routing("gw", "http://gw:1", fake(pages=pages).url, engine="vllm")
    assert router.preflight(routing, Workers(routing.worker_url), observed=observed).problem is None
    other = Routing("gw", "http://gw:1", fake(pages=vllm_pages("/opt/models/other")).url, engine="vllm")
    problem = router.preflight(other, Workers(other.worker_url), observed=observed).problem
    assert 'model_path "/opt/models/other" (this server: "/opt/models/m")' in problem, problem
