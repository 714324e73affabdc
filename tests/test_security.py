"""Attacks a local user, another pod or the network could make, each tried against the real agent.

Several run an attacker as another user (uid 65534 through ``setpriv``), as on a shared GPU host.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tfprofd.daemon.statedir import StateDir
from tfprofd.exporter.hook import Reporter

from helpers import FIXTURES, AgentProcess, http, metric_value, reports_socket, wait_for

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def as_nobody(code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([*NOBODY, sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd="/")


@pytest.fixture
def shared_dir():
    """A directory every user can reach, as /run/tfprofd is for the agent's group (pytest's own are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="tfprofd-sec-"))
    path.chmod(0o755)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def rejected(agent: AgentProcess, reason: str) -> float:
    return metric_value(agent.scrape(), "tfprofd_hook_reports_rejected_total", reason=reason) or 0


def report(pid: int, **fields) -> bytes:
    r = Reporter(job=fields.pop("job", "victim"), worker="0", profiler=False, addr="127.0.0.1:9")
    data = r.report()
    data.update(pid=pid, **fields)
    return json.dumps(data).encode()


# ---- the hook's report socket ----

def test_a_local_user_cannot_speak_for_another_process_or_steer_a_capture(shared_dir):
    agent = AgentProcess(shared_dir, fixtures=False)
    agent.hook_socket = shared_dir / "hook.sock"
    agent.args[agent.args.index("--hook.socket") + 1] = str(agent.hook_socket)
    agent.start()
    try:
        assert stat.S_IMODE(agent.hook_socket.stat().st_mode) == 0o660  # the agent's group only
        agent.hook_socket.chmod(0o666)  # as if the attacker were in that group
        with socket.socket() as victim_server:  # the victim's profiler server: root's port
            victim_server.bind(("127.0.0.1", 0))
            victim_server.listen()
            port = victim_server.getsockname()[1]
            attack = as_nobody(f"""
                import json, os, socket
                from tfprofd.exporter.hook import Reporter
                s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                def send(**fields):
                    r = Reporter(job="victim", worker="0", profiler=False, addr="127.0.0.1:9").report()
                    r.update(fields)
                    s.sendto(json.dumps(r).encode(), "{agent.hook_socket}")
                send(pid=1)  # another process's pid
                send(pid=os.getpid(), profiler="127.0.0.1:{port}")  # a port another user listens on
                send(pid=os.getpid(), profiler="10.0.0.7:{port}")  # a remote host
            """)
            assert attack.returncode == 0, attack.stderr
            wait_for(lambda: rejected(agent, "untrusted_profiler") == 2 and rejected(agent, "pid_mismatch") == 1, 10,
                     message="the three forged reports to be rejected")
        assert metric_value(agent.scrape(), "tfprofd_training_up", training_job="victim") is None
        assert agent.call("POST", "/captures", {"job": "victim"})[0] == 404
    finally:
        agent.stop()


def test_a_udp_report_may_only_name_its_senders_own_profiler(agents):
    agent = agents()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        s.sendto(report(4242, profiler="10.1.2.3:6009"), ("127.0.0.1", agent.hook_port))
        s.sendto(report(4243, job="fine", profiler=f"localhost:{port}"), ("127.0.0.1", agent.hook_port))
        wait_for(lambda: rejected(agent, "untrusted_profiler") == 1, 10, message="the foreign profiler to be rejected")
        wait_for(lambda: metric_value(agent.scrape(), "tfprofd_training_info", training_job="fine",
                                      profiler_address=f"127.0.0.1:{port}") == 1, 10, message="the sender's own port")


def test_a_local_user_cannot_claim_roots_pid_or_profiler_over_udp(agents, gpus):
    """A forged UDP report from uid 65534 naming a root process and root's profiler port is refused; the same
    user's honest report (its own pid, its own port) is accepted and joined to its GPU."""
    agent = agents(env=gpus.env())
    with socket.socket() as root_server:  # root's profiler server, and root's GPU process (this test)
        root_server.bind(("127.0.0.1", 0))
        root_server.listen()
        root_port = root_server.getsockname()[1]
        gpus.update_gpu(0, processes=[{"pid": os.getpid(), "used_memory_bytes": 2**30}])
        attacker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import json, os, socket, sys
            from tfprofd.exporter.hook import Reporter
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            own = socket.socket()
            own.bind(("127.0.0.1", 0))
            own.listen()
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            def send(job, **fields):
                r = Reporter(job=job, worker="0", profiler=False, addr="127.0.0.1:9").report()
                r.update(fields)
                s.sendto(json.dumps(r).encode(), ("127.0.0.1", {agent.hook_port}))
            send("forged", pid={os.getpid()}, profiler="127.0.0.1:{root_port}")  # root's pid and port
            send("forged-pid", pid={os.getpid()})  # root's pid alone
            send("forged-port", pid=os.getpid(), profiler="127.0.0.1:{root_port}")  # root's port alone
            send("honest", pid=os.getpid(), profiler=f"127.0.0.1:{{own.getsockname()[1]}}")
            print(os.getpid(), flush=True)
            sys.stdin.readline()  # the sockets stay open until the test has looked
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
        try:
            attacker_pid = int(attacker.stdout.readline())
            gpus.update_gpu(1, processes=[{"pid": attacker_pid, "used_memory_bytes": 2**30}])
            wait_for(lambda: rejected(agent, "pid_mismatch") == 2 and rejected(agent, "untrusted_profiler") == 1, 20,
                     message="the three forged reports to be refused")
            wait_for(lambda: metric_value(agent.scrape(), "tfprofd_gpu_job_info", gpu="1", training_job="honest"), 20,
                     message="the honest report joined to its GPU")
            text = agent.scrape()
            for job in ("forged", "forged-pid", "forged-port"):
                assert metric_value(text, "tfprofd_training_up", training_job=job) is None
            assert metric_value(text, "tfprofd_gpu_job_info", gpu="0") is None  # nothing joins root's GPU
            assert metric_value(text, "tfprofd_training_info", training_job="honest",
                                profiler_address=f"127.0.0.1:{root_port}") is None
            assert agent.call("POST", "/captures", {"job": "forged"})[0] == 404
            assert agent.call("POST", "/captures", {"job": "forged-port"})[0] == 404
            assert "refused: pid" in agent.log() and "(uid 65534)" in agent.log()
        finally:
            attacker.communicate("\n", timeout=10)


def test_a_loopback_report_from_no_socket_of_this_host_is_refused(tmp_path):
    from tfprofd.exporter.training import Rejected, identify_udp_sender

    (tmp_path / "self").mkdir()
    shutil.copytree(FIXTURES / "proc" / "net", tmp_path / "self" / "net")  # root: 127.0.0.1:41000, nobody: *:38272
    assert identify_udp_sender("127.0.0.1", 41000, tmp_path).uid == 0
    assert identify_udp_sender("127.0.0.1", 38272, tmp_path).uid == 65534
    with pytest.raises(Rejected) as info:  # no socket of this host sends from there: nobody vouches for it
        identify_udp_sender("127.0.0.1", 41005, tmp_path)
    assert info.value.reason == "unverified_sender"
    assert identify_udp_sender("192.0.2.7", 41005, tmp_path).uid is None  # a remote peer (a pod): its address only


def test_a_hosts_udp_sender_joins_only_its_own_pid(tmp_path):
    """From loopback another user's pid is refused; from a host address (a hostNetwork pod, whose pid is its
    own namespace's) it is kept but never joined to NVML's pids."""
    from tfprofd.exporter.training import Rejected, Sender, check_pid, parse_report

    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "status").write_text("Name:\ttrain\nUid:\t0\t0\t0\t0\n")  # root's process
    root_pid = parse_report(report(4242), 8192)
    assert check_pid(root_pid, Sender(local=False, address="127.0.0.1", uid=0, port=1), tmp_path)
    with pytest.raises(Rejected) as info:
        check_pid(root_pid, Sender(local=False, address="127.0.0.1", uid=1000, port=1), tmp_path)
    assert info.value.reason == "pid_mismatch"
    assert not check_pid(root_pid, Sender(local=False, address="10.0.0.5", uid=1000, port=1), tmp_path)
    assert not check_pid(parse_report(report(4343), 8192), Sender(local=False, address="127.0.0.1", uid=0, port=1),
                         tmp_path)  # no such process here
    assert not check_pid(root_pid, Sender(local=False, address="10.0.0.5"), tmp_path)  # a pod: means nothing


@pytest.mark.parametrize("profiler", ["127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:-1", "bad host!:80", "[::1:80",
                                      "x" * 300 + ":80", "::1:80"])
def test_invalid_profiler_addresses_are_rejected(profiler):
    from tfprofd.exporter.training import Rejected, parse_report

    with pytest.raises(Rejected) as info:
        parse_report(report(42, profiler=profiler), 8192)
    assert info.value.reason == "invalid_field"


def test_deep_nesting_and_garbage_never_kill_the_listener(agents):
    agent = agents()
    with reports_socket() as s:
        for payload in (b"[" * 2000, b"{" * 5000, b'{"v":' * 1000, b"\x00" * 100, b"[1" + b",[1" * 1500):
            s.sendto(payload, ("127.0.0.1", agent.hook_port))
        s.sendto(report(7, job="after"), ("127.0.0.1", agent.hook_port))
    wait_for(lambda: metric_value(agent.scrape(), "tfprofd_training_up", training_job="after") == 1, 10,
             message="a valid report after the hostile ones")
    assert rejected(agent, "too_deep") >= 3
    assert http("GET", agent.url + "/healthz")[0] == 200


def test_histogram_counts_going_backwards_are_rejected(agents):
    agent = agents()
    first = json.loads(report(9, seq=1, step_seconds={"count": 10, "sum": 1.0, "buckets": [0] * 9 + [10] * 6}))
    second = {**first, "seq": 2, "step_seconds": {"count": 10, "sum": 0.5, "buckets": [0] * 9 + [10] * 6}}
    with reports_socket() as s:
        for r in (first, second):
            s.sendto(json.dumps(r).encode(), ("127.0.0.1", agent.hook_port))
    wait_for(lambda: rejected(agent, "counter_decreased") == 1, 10, message="the decreasing sum to be rejected")


def test_a_flood_of_job_names_is_bounded_by_max_jobs(agents):
    agent = agents(args=["--hook.max-jobs", "200"])
    with reports_socket() as s:
        for i in range(1500):
            s.sendto(report(1000 + i, job=f"flood-{i}"), ("127.0.0.1", agent.hook_port))
            if i % 100 == 0:
                time.sleep(0.01)  # a loopback receive buffer still drops under a burst
    wait_for(lambda: metric_value(agent.scrape(), "tfprofd_hook_jobs") == 200, 20, message="200 jobs tracked")
    assert rejected(agent, "too_many_jobs") > 0
    text = agent.scrape()
    assert text.count("tfprofd_training_up{") == 200
    assert agent.log().count("reporting: pid") <= 20 + 1  # the per-job log line is rate-limited


# ---- files the agent writes, and deletes ----

def test_retention_never_follows_a_link_and_counts_what_it_freed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"x" * 1000)
    state = StateDir(tmp_path)
    state.ensure_dir("captures", 0o750)
    capture = tmp_path / "captures" / "20261121T101010Z-abcdef"
    (capture / "plugins").mkdir(parents=True)
    (capture / "plugins" / "trace.xplane.pb").write_bytes(b"y" * 500)
    (capture / "link-to-outside").symlink_to(outside)
    (capture / "plugins" / "file-link").symlink_to(outside / "precious")
    os.link(outside / "precious", capture / "hardlink")  # deleting it frees nothing
    freed, left = state.remove_tree("captures", capture.name)
    assert (freed, left) == (500, [])
    assert (outside / "precious").read_bytes() == b"x" * 1000 and not capture.exists()


def test_what_retention_cannot_delete_is_reported_not_hidden(shared_dir):
    capture = shared_dir / "state" / "captures" / "capture"
    (capture / "theirs").mkdir(parents=True)
    (capture / "mine").write_bytes(b"z" * 300)
    (capture / "theirs" / "trace").write_bytes(b"w" * 700)  # a training user's file, in a directory of theirs
    subprocess.run(["chown", "-R", "65534:65534", str(shared_dir / "state")], check=True)
    (capture / "theirs").chmod(0o755)
    os.chown(capture / "theirs", 0, 0)  # owned by another user than the deleting agent (here nobody)
    result = as_nobody(f"""
        import json
        from pathlib import Path
        from tfprofd.daemon.statedir import StateDir
        print(json.dumps(StateDir(Path("{shared_dir / "state"}")).remove_tree("captures", "capture")))
    """)
    freed, left = json.loads(result.stdout)
    assert freed == 300 and any("theirs/trace" in problem and "Permission denied" in problem for problem in left)


def test_a_group_member_who_swaps_captures_for_a_link_redirects_nothing(shared_dir):
    """The chart's 2770 state directory: a member of its group renames captures/ and links it to a victim's
    directory; the next capture is refused (507, logged, counted) and nothing is written or deleted there."""
    agent = AgentProcess(shared_dir, args=["--captures.keep", "1", "--captures.max-per-hour", "100"])
    agent.start()
    try:
        state = shared_dir / "state"

        def capture(job: str) -> tuple[int, dict]:
            with reports_socket() as s, socket.socket() as server:
                server.bind(("127.0.0.1", 0))
                server.listen()  # the job's own port when it reports; closed when the capture comes: it fails
                s.sendto(report(os.getpid(), job=job, profiler=f"127.0.0.1:{server.getsockname()[1]}"),
                         ("127.0.0.1", agent.hook_port))
                wait_for(lambda: metric_value(agent.scrape(), "tfprofd_training_up", training_job=job) == 1, 10,
                         message=f"job {job}")
            return agent.call("POST", "/captures", {"job": job})

        status, first = capture("one")
        assert status == 202, first
        wait_for(lambda: agent.call("GET", f"/captures/{first['id']}")[1]["status"] == "failed", 30,
                 message="the first capture to end")
        victim = shared_dir / "victim"
        (victim / first["id"]).mkdir(parents=True)
        (victim / first["id"] / "important.db").write_bytes(b"v" * 100)
        os.chown(state, 0, 65534)
        state.chmod(0o2770)  # the chart's state directory; nobody is in its group
        swap = subprocess.run([*NOBODY[:-1], "--groups=65534", "sh", "-c",
                               f"mv {state}/captures {state}/captures.old && ln -s {victim} {state}/captures"],
                              capture_output=True, text=True)
        assert swap.returncode == 0, swap.stderr
        status, answer = capture("two")
        assert status == 507 and "refusing to follow" in answer["error"], answer
        assert sorted(p.name for p in victim.rglob("*")) == [first["id"], "important.db"]
        assert (victim / first["id"] / "important.db").read_bytes() == b"v" * 100
        wait_for(lambda: (metric_value(agent.scrape(), "tfprofd_state_dir_refused_total", kind="directory") or 0) >= 1,
                 10, message="the refusal counted")
        assert f"{state}/captures is a symbolic link or not a directory; refusing to follow it" in agent.log()
        status, health = http("GET", agent.url + "/healthz")
        assert status == 200 and "refusing to follow" in health["storage_problem"], health
    finally:
        agent.stop()


@pytest.mark.parametrize("capture_id", ["20261121T101010Z-abcdef\n", "../20261121T101010Z-abcdef", ""])
def test_a_capture_id_is_the_whole_name_or_none(tmp_path, capture_id):
    """A capture's id names its directory: an id followed by a newline (``$`` matched before it) is not one."""
    from tfprofd.daemon.records import RecordStore

    store = RecordStore(tmp_path)
    with pytest.raises(ValueError, match="is not a capture id"):
        store.capture_dir(capture_id)
    assert store.capture_dir("20261121T101010Z-abcdef").name == "20261121T101010Z-abcdef"


def _store_with_a_record(state: Path):
    from tfprofd.daemon.records import CaptureRecord, RecordStore

    store = RecordStore(state)
    record = CaptureRecord(id="20261121T101010Z-abcdef", trigger="manual", job="j", targets=[], requested_at=1.0,
                           duration_ms=1000, mode="agent", status="done")
    store.create_capture_dir(record.id, 0o750)
    (state / "captures" / record.id / "trace.pb").write_bytes(b"t" * 10)
    store.save(record)
    return store, record


_SERVER_MODE_CAPTURE = """
import json, sys
from pathlib import Path
from tfprofd.daemon.capture_worker import capture_server_mode
request = {"targets": ["127.0.0.1:1"], "host_tracer_level": 2, "device_tracer_level": 1, "python_tracer_level": 0,
           "delay_ms": 0, "duration_ms": 100, "max_trace_bytes": 1 << 20}
print(json.dumps(capture_server_mode(request, Path(sys.argv[1]))))
"""


def test_links_planted_in_a_server_mode_capture_are_neither_followed_nor_deleted_through(tmp_path):
    """In server mode the capture's directory is the training processes' group's to write (captures.dir_mode):
    a member plants links where xprof's client writes traces. The worker read, judged empty and deleted a
    trace through them (and would read /dev/zero without end); now it opens nothing through a link and
    nothing that is not a regular file, and deletes no entry it did not find there."""
    victim = tmp_path / "elsewhere"
    (victim / "profile" / "run").mkdir(parents=True)
    (victim / "profile" / "run" / "someone_elses.xplane.pb").write_bytes(b"not a trace of this capture")
    outside = tmp_path / "outside.xplane.pb"
    outside.write_bytes(b"another file outside the capture")
    linked_dir, linked_files = tmp_path / "capture-1", tmp_path / "capture-2"
    linked_dir.mkdir()
    (linked_dir / "plugins").symlink_to(victim)  # the whole tree under a link
    run = linked_files / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    (run / "planted.xplane.pb").symlink_to(outside)  # a trace file that is a link
    os.mkfifo(run / "fifo.xplane.pb")  # opened without O_NONBLOCK, a read waits for a writer for ever
    for logdir in (linked_dir, linked_files):
        done = subprocess.run([sys.executable, "-c", _SERVER_MODE_CAPTURE, str(logdir)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        result = json.loads(done.stdout.splitlines()[-1])
        assert (result["reason"], result["files"]) == ("no_server", []), result
    assert sorted(str(p.relative_to(victim)) for p in victim.rglob("*")) == [
        "profile", "profile/run", "profile/run/someone_elses.xplane.pb"]
    assert outside.read_bytes() == b"another file outside the capture"
    assert (run / "planted.xplane.pb").is_symlink() and stat.S_ISFIFO((run / "fifo.xplane.pb").lstat().st_mode)


_MANY_RUNS = """
import lzma, os, resource, sys
from pathlib import Path
from tfprofd.daemon.capture_worker import _server_traces
logdir = Path(sys.argv[1])
profile = logdir / "plugins" / "profile"
for i in range(300):
    (profile / f"run-{i:03d}").mkdir(parents=True)
(profile / "run-999" / "0.xplane.pb").mkdir(parents=True)  # a directory by a trace's name opens (O_RDONLY) too
(profile / "run-999" / "host_1.xplane.pb").write_bytes(lzma.decompress(Path(sys.argv[2]).read_bytes()))
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
print([(str(t.path), t.empty) for t in _server_traces(logdir, 1 << 30)])
"""


def test_a_capture_directory_with_thousands_of_run_directories_still_finds_its_trace(tmp_path):
    """Each run directory stayed open until the scan ended: a group member's empty directories ran the worker
    out of descriptors (EMFILE), and the capture failed with its trace lost; a directory named like a trace
    leaked its descriptor and hid the traces after it."""
    trace = FIXTURES / "traces" / "plain-baseline.xplane.pb.xz"
    done = subprocess.run([sys.executable, "-c", _MANY_RUNS, str(tmp_path), str(trace)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[('plugins/profile/run-999/host_1.xplane.pb', False)]"

def test_retention_refuses_a_capture_directory_swapped_for_a_link(tmp_path):
    state, victim = tmp_path / "state", tmp_path / "victim"
    state.mkdir()
    store, record = _store_with_a_record(state)
    (victim / record.id).mkdir(parents=True)
    (victim / record.id / "important.db").write_bytes(b"v" * 100)
    shutil.rmtree(state / "captures" / record.id)
    (state / "captures" / record.id).symlink_to(victim / record.id)
    assert store.delete(record) == 0
    assert (victim / record.id / "important.db").read_bytes() == b"v" * 100
    assert (state / "records" / f"{record.id}.json").exists()  # left with its directory, for a person to see
    assert store.state.refused["capture"] == 1
    assert store.capture_bytes(record.id) == 0  # nor are its bytes counted
    os.unlink(state / "captures" / record.id)
    os.rename(state / "captures", state / "captures.old")
    (state / "captures").symlink_to(victim)  # the whole captures/ swapped: retention must not delete through it
    assert store.delete(record) == 0
    assert (victim / record.id / "important.db").read_bytes() == b"v" * 100
    assert store.state.refused["directory"] == 1


def test_records_swapped_for_another_directory_or_a_link_are_refused(tmp_path, caplog):
    from tfprofd.daemon.statedir import StateDirSwapped

    state, victim = tmp_path / "state", tmp_path / "victim"
    state.mkdir()
    victim.mkdir()
    (victim / "important.db").write_bytes(b"v")
    store, record = _store_with_a_record(state)
    os.rename(state / "records", state / "records.old")
    (state / "records").mkdir(mode=0o700)  # the agent's own user, but not the directory the agent made
    with pytest.raises(StateDirSwapped):
        store.save(record)
    os.rmdir(state / "records")
    (state / "records").symlink_to(victim)
    with pytest.raises(StateDirSwapped):
        store.save(record)
    with pytest.raises(StateDirSwapped):
        list(store.load())
    assert sorted(p.name for p in victim.iterdir()) == ["important.db"]
    assert store.state.refused["directory"] == 3
    assert "is not the directory the agent made there" in caplog.text


def test_a_record_file_swapped_for_a_link_is_set_aside_not_followed(tmp_path):
    state, victim = tmp_path / "state", tmp_path / "victim.json"
    state.mkdir()
    store, record = _store_with_a_record(state)
    victim.write_text('{"id": "20261121T101010Z-abcdef"}')
    path = state / "records" / f"{record.id}.json"
    path.unlink()
    path.symlink_to(victim)
    assert list(store.load()) == []
    assert victim.read_text() == '{"id": "20261121T101010Z-abcdef"}'
    assert store.state.refused["file"] == 1  # counted, not only set aside
    assert [p.name.startswith(f"{record.id}.json.bad-") for p in (state / "records").iterdir()] == [True]
    store.save(record)  # a new record file takes the link's place; the victim is not written
    assert victim.read_text() == '{"id": "20261121T101010Z-abcdef"}' and not path.is_symlink()


def test_no_directory_the_agent_makes_is_world_writable_and_records_are_private(agents, tmp_path):
    agent = agents(args=["--captures.mode", "server"])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()  # the sender's own port when it reports; closed when the capture comes
        s.sendto(report(77, job="j", profiler=f"127.0.0.1:{server.getsockname()[1]}"), ("127.0.0.1", agent.hook_port))
        wait_for(lambda: metric_value(agent.scrape(), "tfprofd_training_up", training_job="j") == 1, 10,
                 message="job j")
    status, answer = agent.call("POST", "/captures", {"job": "j"})
    assert status == 202, answer
    wait_for(lambda: agent.call("GET", f"/captures/{answer['id']}")[1]["status"] == "failed", 30, message="the capture")
    state = tmp_path / "state"
    for path in [state, *state.rglob("*")]:
        mode = path.lstat().st_mode
        assert not mode & stat.S_IWOTH, f"{path} is world-writable ({stat.filemode(mode)})"
    assert stat.S_IMODE((state / "records").stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "api.token").stat().st_mode) == 0o640
    assert stat.S_IMODE((state / "captures" / answer["id"]).stat().st_mode) == 0o770  # server mode: group writes


def test_a_planted_link_where_the_token_goes_is_not_followed(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o750)
    victim = tmp_path / "victim"
    victim.write_text("do not touch\n")
    (state / "api.token").symlink_to(victim)
    result = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "run", "--state-dir", str(state), "--listen",
                             "127.0.0.1:0", "--api.listen", "127.0.0.1:0", "--hook.socket", str(tmp_path / "h.sock")],
                            capture_output=True, text=True, timeout=10)
    assert result.returncode == 1 and "api.token" in result.stderr, result.stderr
    assert victim.read_text() == "do not touch\n"


# ---- the control API ----

def test_the_generated_token_guards_the_api_and_the_capture_command_finds_it(agents, tmp_path):
    agent = agents()
    token = agent.token
    assert len(token) >= 32
    assert http("GET", agent.api + "/captures")[0] == 401
    assert http("GET", agent.api + "/captures", token=token)[0] == 200
    env = {**os.environ, "TFPROFD_STATE_DIR": str(tmp_path / "state")}
    result = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "capture", "--api",
                             f"http://127.0.0.1:{agent.api_port}"], capture_output=True, text=True, env=env)
    assert result.returncode == 1 and "capture refused (404)" in result.stderr, result.stderr  # authenticated
    denied = as_nobody(f"""
        import urllib.request
        try:
            urllib.request.urlopen("http://127.0.0.1:{agent.api_port}/api/v1/captures")
        except Exception as exc:
            print(getattr(exc, "code", exc))
        print(open("{tmp_path / 'state' / 'api.token'}").read())
    """)
    assert denied.stdout.startswith("401") and "Permission denied" in denied.stderr


# ---- the HTTP server under idle connections ----

def test_a_thousand_idle_connections_do_not_stop_metrics_or_the_collectors(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    agent = AgentProcess(tmp_path, fixtures=False)
    # The file-descriptor limit a plain service gets.
    agent.start_prefix = ["prlimit", "--nofile=1024:1024"]
    agent.start()
    held = []
    try:
        for _ in range(1100):
            held.append(socket.create_connection(("127.0.0.1", agent.port), timeout=10))
        wait_for(lambda: (metric_value(agent.scrape(), "tfprofd_http_connections_evicted_total", server="metrics")
                          or 0) >= 900, 30, message="the idle connections to be accepted")
        status, _ = http("GET", agent.url + "/metrics", timeout=10)  # a starved server never answers
        assert status == 200
        for collector in ("cpu", "memory", "disk", "network", "training"):
            assert metric_value(agent.scrape(), "tfprofd_collector_success", collector=collector) == 1, collector
        assert "Too many open files" not in agent.log()
    finally:
        for s in held:
            s.close()
        agent.stop()
