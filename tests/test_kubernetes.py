"""The Kubernetes launch (k8s/pytorchjob.yaml, k8s/jobset.yaml, scripts/train_k8s.sh).

The manifests are checked against the models of the kubeflow-training SDK (the PyTorchJob whole) and of
the kubernetes client (the JobSet's Job template; no JobSet schema installs offline: JobSet publishes no
package): a field either does not know fails, as does a missing required one.

The slow tier runs each manifest's pods as two network namespaces (veth pair; the pod's host name in a
UTS namespace of its own; the cluster DNS as the namespace's /etc/hosts, which `ip netns exec` mounts),
each with the manifest's command and env plus what its controller adds, sharing the checkpoint folder
as the pods share their volume. The pods train; SIGTERM to a pod's main process, as the kubelet sends
it, makes every rank save and every pod fail with status 1 after their ranks' 143 (a restart); the
restarted pods resume and finish."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import yaml

from fms_fsdp.checkpoint.layout import complete_checkpoints
from fms_fsdp.errors import ConfigError
from fms_fsdp.flags import parse_args

from conftest import ROOT, TINY
from held_at import wait_held
from test_checkpoint import alive, descendants

PYTORCHJOB, JOBSET = ROOT / "k8s" / "pytorchjob.yaml", ROOT / "k8s" / "jobset.yaml"
NPROC = 2  # processes per "pod" here (CPU)


class _Body:
    """What the SDKs' ApiClient.deserialize reads: a response's JSON text."""

    def __init__(self, doc: Any):
        self.data = json.dumps(doc)


def _round_trip(api: Any, doc: Any, model: str) -> Any:
    """`doc` read by the SDK's model `model` and written back: equal to `doc` when every field is known."""
    return api.sanitize_for_serialization(api.deserialize(_Body(doc), model))


def check_pytorchjob(doc: dict) -> None:
    from kubeflow.training import ApiClient

    assert _round_trip(ApiClient(), doc, "KubeflowOrgV1PyTorchJob") == doc, "a field the SDK does not know"


def check_jobset(doc: dict) -> None:
    from kubernetes.client import ApiClient

    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    assert set(doc["spec"]) <= {"failurePolicy", "network", "replicatedJobs", "successPolicy", "startupPolicy"}
    for job in doc["spec"]["replicatedJobs"]:
        assert set(job) == {"name", "replicas", "template"}
        assert _round_trip(ApiClient(), job["template"], "V1JobTemplateSpec") == job["template"]


def _container(pod_template: dict) -> dict:
    (container,) = pod_template["spec"]["containers"]
    return container


def test_the_manifests_are_valid_and_leave_room_for_the_preemption_save():
    job, jobset = yaml.safe_load(PYTORCHJOB.read_text()), yaml.safe_load(JOBSET.read_text())
    check_pytorchjob(job)
    check_jobset(jobset)
    job_set_job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    templates = [spec["template"] for spec in job["spec"]["pytorchReplicaSpecs"].values()] + [job_set_job["template"]]
    for template in templates:
        container, spec = _container(template), template["spec"]
        assert spec["terminationGracePeriodSeconds"] >= 120  # steps, a step and a save of a large model
        assert container["command"] == ["bash", "scripts/train_k8s.sh"] and (ROOT / container["command"][1]).exists()
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert "persistentVolumeClaim" in volumes[mounts["/ckpt"]]
        assert (
            container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
        )
    assert _container(templates[0])["name"] == "pytorch"  # the container the operator sets up
    assert {p["name"] for p in _container(templates[0])["ports"]} == {"pytorchjob-port"}
    env = {e["name"]: e for e in _container(job_set_job["template"])["env"]}
    assert int(env["NNODES"]["value"]) == job_set_job["parallelism"] == job_set_job["completions"]
    assert job_set_job["completionMode"] == "Indexed" and job_set_job["backoffLimit"] == 0


def test_the_validation_catches_an_unknown_field_and_a_missing_required_one():
    job = yaml.safe_load(PYTORCHJOB.read_text())
    typo = copy.deepcopy(job)
    _container(typo["spec"]["pytorchReplicaSpecs"]["Master"]["template"])["volumeMount"] = []
    with pytest.raises(AssertionError, match="a field the SDK does not know"):
        check_pytorchjob(typo)
    nameless = copy.deepcopy(job)
    del _container(nameless["spec"]["pytorchReplicaSpecs"]["Worker"]["template"])["name"]
    with pytest.raises(ValueError, match="name"):
        check_pytorchjob(nameless)
    jobset = yaml.safe_load(JOBSET.read_text())
    jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["paralelism"] = 2
    with pytest.raises(AssertionError):
        check_jobset(jobset)


def test_the_entry_point_names_what_is_missing():
    env = {"PATH": os.environ["PATH"], "JOB_COMPLETION_INDEX": "1", "NNODES": "2", "JOBSET_NAME": "llama"}
    proc = subprocess.run(["bash", "scripts/train_k8s.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: JobSet: REPLICATED_JOB_NAME is not set; give it in the container's env (see k8s/jobset.yaml)\n"
    )
    proc = subprocess.run(
        ["bash", "scripts/train_k8s.sh"], cwd=ROOT, env={"PATH": os.environ["PATH"]}, capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: no rendezvous in the environment: ")


def _pod_env(bin_dir: Path) -> dict[str, str]:
    """A PyTorchJob pod's environment, `bin_dir` first on PATH (its python, or a torchrun of the test's)."""
    return {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
        **{f"PET_{k}": v for k, v in (("NNODES", "1"), ("NODE_RANK", "0"), ("NPROC_PER_NODE", "2"))},
        **{"PET_MASTER_ADDR": "localhost", "PET_MASTER_PORT": "29500"},
    }


def test_the_entry_point_ends_a_bad_flag_in_its_one_line_before_torchrun(tmp_path):
    """Status 2, which the manifests do not restart, and no torchrun (one on PATH would leave a mark)."""
    torchrun = tmp_path / "torchrun"
    torchrun.write_text(f"#!/bin/sh\ntouch {tmp_path / 'started'}\n")
    torchrun.chmod(0o755)
    proc = subprocess.run(
        ["bash", "scripts/train_k8s.sh", "--lerning_rate=1e-3"],
        cwd=ROOT,
        env={**_pod_env(tmp_path), "TORCHRUN": str(torchrun)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stdout + proc.stderr
    assert proc.stderr == "error: unknown flag --lerning_rate; did you mean --learning_rate?\n"
    assert not (tmp_path / "started").exists()
    jobset = yaml.safe_load(JOBSET.read_text())["spec"]["replicatedJobs"][0]["template"]["spec"]
    (rule,) = jobset["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"] == {"operator": "In", "values": [2]}


RANK = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)); time.sleep(60)"


def test_a_sigterm_before_the_ranks_start_reaches_them(tmp_path):
    """SIGTERM while torchrun (here a stand-in that starts its two ranks only once the test lets it) has
    no ranks yet: the entry point sends it on once they exist, and they stop (no 60 s wait)."""
    torchrun, release = tmp_path / "torchrun", tmp_path / "release"
    torchrun.write_text(
        f"#!{sys.executable}\nimport os, subprocess, sys, time\n"
        f"t = time.time()\nwhile not os.path.exists({str(release)!r}) and time.time() < t + 30:\n    time.sleep(0.02)\n"
        f"ranks = [subprocess.Popen([sys.executable, '-c', {RANK!r}], start_new_session=True) for _ in range(2)]\n"
        "codes = [r.wait() for r in ranks]\nprint('ranks:', codes)\nsys.exit(1 if any(codes) else 0)\n"
    )
    torchrun.chmod(0o755)
    env = {**_pod_env(tmp_path), "TORCHRUN": str(torchrun)}
    proc = subprocess.Popen(["bash", "scripts/train_k8s.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert "torchrun node 0 of 1 x 2 process(es)" in proc.stdout.readline()  # torchrun is starting
        start = time.time()
        proc.send_signal(signal.SIGTERM)
        # the entry point took it while torchrun has started no rank (it waits for `release`)
        assert proc.stdout.readline() == "SIGTERM: every rank saves a checkpoint and stops\n"
    finally:
        release.touch()
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1 and time.time() - start < 20, output
    codes = output.split("ranks: ")[1].splitlines()[0]
    assert set(eval(codes)) <= {143, -signal.SIGTERM}, codes


@pytest.mark.slow  # a run trained, stopped and saved (about 18 s): the slow tier
def test_a_run_stopped_by_sigterm_exits_with_stop_exit_status(tmp_path):
    """One process, no torchrun: SIGTERM, the checkpoint, then --stop_exit_status instead of 0."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [
        *TINY,
        f"--ckpt_save_path={out}",
        "--num_steps=1000",
        "--checkpoint_interval=1000",
        "--stop_exit_status=143",
    ]
    proc = subprocess.Popen(
        [sys.executable, "main_training.py", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    while not _records(out) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    saved = complete_checkpoints(out / "checkpoints")[-1][0]
    assert proc.returncode == 143, output[-3000:]
    assert (
        f"stopping after step {saved} on SIGTERM: the checkpoint is saved, resume by running the same command "
        "(exit status 143, --stop_exit_status)"
    ) in output


def test_stop_exit_status_is_an_exit_status():
    with pytest.raises(ConfigError) as e:
        parse_args(["--stop_exit_status=256"])
    assert str(e.value) == "--stop_exit_status: must be <= 255 (an exit status), got 256"


# ------------------------------------------------------------------------------ pods in namespaces


def _pytorchjob_pods(nodes: int) -> list[dict]:
    """Each pod of k8s/pytorchjob.yaml, scaled to `nodes` pods of NPROC processes: its host name, its
    command and its env: the manifest's, then what the training operator adds (pkg/controller.v1/pytorch:
    master and PET_* variables)."""
    job = yaml.safe_load(PYTORCHJOB.read_text())
    name, specs = job["metadata"]["name"], job["spec"]["pytorchReplicaSpecs"]
    master = f"{name}-master-0"  # the master's Service
    port = next(p["containerPort"] for p in _container(specs["Master"]["template"])["ports"])
    pods = []
    for rank in range(nodes):
        kind, index = ("master", 0) if rank == 0 else ("worker", rank - 1)
        container = _container(specs[kind.capitalize()]["template"])
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        env |= {
            "PYTHONUNBUFFERED": "0",
            "MASTER_ADDR": master,
            "MASTER_PORT": str(port),
            "PET_MASTER_ADDR": master,
            "PET_MASTER_PORT": str(port),
            "WORLD_SIZE": str(nodes * NPROC),
            "RANK": str(rank),
            "PET_NPROC_PER_NODE": str(NPROC),
            "PET_NODE_RANK": str(rank),
            "PET_NNODES": str(nodes),
        }
        pods.append({"host": f"{name}-{kind}-{index}", "command": container["command"], "env": env})
    return pods


def _jobset_pods(nodes: int) -> list[dict]:
    """Each pod of k8s/jobset.yaml, scaled to `nodes` pods of NPROC processes: its host name
    (<jobset>-<replicated job>-0-<index>), its command and its env: the manifest's with its fieldRefs to
    the pod's JobSet labels resolved, and JOB_COMPLETION_INDEX from the Job controller."""
    jobset = yaml.safe_load(JOBSET.read_text())
    name, replicated = jobset["metadata"]["name"], jobset["spec"]["replicatedJobs"][0]
    container = _container(replicated["template"]["spec"]["template"])
    labels = {"jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"]}
    env = {}
    for e in container["env"]:
        if "valueFrom" in e:
            label = e["valueFrom"]["fieldRef"]["fieldPath"].split("['")[1].rstrip("']")
            env[e["name"]] = labels[label]
        else:
            env[e["name"]] = e["value"]
    env |= {"NNODES": str(nodes), "NPROC_PER_NODE": str(NPROC)}  # the manifest, scaled to this machine
    return [
        {
            "host": f"{name}-{replicated['name']}-0-{i}",
            "command": container["command"],
            "env": {**env, "JOB_COMPLETION_INDEX": str(i)},
            "subdomain": name,
        }
        for i in range(nodes)
    ]


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture
def network() -> Iterator[list[tuple[str, str]]]:
    """Two network namespaces joined by a veth pair: [(namespace, address)] for 10.78.0.1 and .2;
    skipped where they cannot be made (not root, no iproute2)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs root, iproute2's ip and util-linux's unshare (apt-get install iproute2)")
    tag = uuid.uuid4().hex[:4]
    spaces = [(f"fms-k{tag}{i}", f"10.78.0.{i + 1}") for i in range(2)]
    try:
        steps = [("ip", "link", "add", f"fk{tag}0", "type", "veth", "peer", "name", f"fk{tag}1")]
        for i, (ns, addr) in enumerate(spaces):
            made = _sh("ip", "netns", "add", ns)
            if made.returncode != 0:
                pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")
            steps += [
                ("ip", "-n", ns, "link", "set", "lo", "up"),
                ("ip", "link", "set", f"fk{tag}{i}", "netns", ns),
                ("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", f"fk{tag}{i}"),
                ("ip", "-n", ns, "link", "set", f"fk{tag}{i}", "up"),
            ]
        for step in steps:
            done = _sh(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot wire the namespaces ({' '.join(step)}): {done.stderr.strip()}")
        yield spaces
    finally:
        for ns, _ in spaces:
            _sh("ip", "netns", "del", ns)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def _held_torchrun(folder: Path, held: Path, point: str) -> Path:
    """`folder`, holding a `torchrun` that execs the scripts' own (fms-torchrun) with the training script
    held at `point` (tests/held_at.py, its files in `held`): a pod's TORCHRUN."""
    folder.mkdir()
    real = f"{sys.executable} -c 'from fms_fsdp.cli import torchrun; torchrun()'"
    wrapper = ROOT / "tests" / "held_at.py"
    (folder / "torchrun").write_text(f'#!/bin/sh\nexec {real} {wrapper} {held} {point} "$@"\n')
    (folder / "torchrun").chmod(0o755)
    return folder


def _start(
    pods: list[dict], network: list[tuple[str, str]], args: list[str], bin_dir: Optional[Path] = None
) -> list[subprocess.Popen]:
    """Each pod in its namespace, its host name set, the cluster's names in its /etc/hosts; the pod's
    main process, scripts/train_k8s.sh, is the Popen's (ip netns exec, unshare and sh exec one another).
    `bin_dir`: first on the pods' PATH."""
    names = []
    for pod, (_, addr) in zip(pods, network):
        full = f"{pod['host']}.{pod['subdomain']}" if "subdomain" in pod else pod["host"]
        names.append(f"{addr} {full} {pod['host']}")
    if "subdomain" not in pods[0]:  # the PyTorchJob master's Service
        names.append(f"{network[0][1]} {pods[0]['env']['PET_MASTER_ADDR']}")
    procs = []
    for pod, (ns, _) in zip(pods, network):
        Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
        Path(f"/etc/netns/{ns}/hosts").write_text("127.0.0.1 localhost\n" + "\n".join(names) + "\n")
        # the image's environment: its PATH (python and torchrun) and HOME; one thread per rank on 2 cores
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/root", "OMP_NUM_THREADS": "1"}
        if bin_dir is not None:
            env["PATH"], env["TORCHRUN"] = f"{bin_dir}:{env['PATH']}", str(bin_dir / "torchrun")
        cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', pod["host"]]
        procs.append(
            subprocess.Popen(
                [*cmd, *pod["command"], *args],
                cwd=ROOT,
                env={**env, **pod["env"]},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(procs: list[subprocess.Popen], seconds: float) -> list[str]:
    """The pods' outputs once every process of theirs has ended (SIGKILL after `seconds`, as the kubelet
    does after the grace period, which fails the test)."""
    everything = [pid for p in procs for pid in (p.pid, *descendants(p.pid))]
    deadline = time.time() + seconds
    while any(alive(pid) for pid in everything) and time.time() < deadline:
        time.sleep(0.2)
    left = [pid for pid in everything if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    outputs = [p.communicate(timeout=30)[0] for p in procs]
    assert not left, "the pods outlived their grace period:\n" + "\n".join(o[-3000:] for o in outputs)
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("manifest", ["pytorchjob", "jobset"])
def test_pods_train_save_on_sigterm_fail_for_a_restart_and_resume(manifest, network, tmp_path):
    """PyTorchJob: only the worker's pod is taken away (an eviction); JobSet: every pod (the set preempted)."""
    out = tmp_path / "run"  # the checkpoint volume every pod mounts
    steps = 6  # the save is at step 1 (below), the restarted pods train the rest
    args = [*TINY, f"--ckpt_save_path={out}", f"--num_steps={steps}", "--checkpoint_interval=1000", "--batch_size=2"]
    pods = (_pytorchjob_pods if manifest == "pytorchjob" else _jobset_pods)(len(network))
    # every rank waits at the ranks' first agreement on stop signals (tests/held_at.py), where the SIGTERM
    # reaches it and is agreed: step 1's, as the later ones fall every ~2 s of measured steps
    # (resilience/triggers.py), which on a fast machine can be the run's last step
    held = tmp_path / "held"
    procs = _start(pods, network, args, _held_torchrun(tmp_path / "bin", held, "agree:1"))
    signalled = procs[1:] if manifest == "pytorchjob" else procs
    ranks = {f"signalled-{NPROC * procs.index(p) + r}" for p in signalled for r in range(NPROC)}
    deadline = time.time() + 240
    wait_held(held, NPROC * len(procs), procs, timeout=240, said=lambda: _wait(procs, 5))
    for p in signalled:
        p.send_signal(signal.SIGTERM)  # the kubelet's, to the container's main process alone
    # sent on by the pods' entry points
    wait_held(held, len(ranks), procs, deadline - time.time(), files="signalled-*", said=lambda: _wait(procs, 5))
    assert {f.name for f in held.glob("signalled-*")} == ranks
    (held / "release").touch()
    outputs = _wait(procs, 120)
    assert all(("SIGTERM: every rank saves" in o) == (p in signalled) for p, o in zip(procs, outputs))
    assert [p.returncode for p in procs] == [1, 1], outputs  # failed: the controller restarts them
    saved = complete_checkpoints(out / "checkpoints")[-1][0]
    assert saved == 1  # the agreement the signal came in: every rank stopped there
    stop_line = (
        f"stopping after step {saved} on SIGTERM: the checkpoint is saved, resume by running the same command "
        "(exit status 143, --stop_exit_status)"
    )
    assert stop_line in outputs[0], outputs[0][-3000:]
    assert "torchrun node 0 of 2 x 2 process(es)" in outputs[0] and "torchrun node 1 of 2" in outputs[1]

    procs = _start(pods, network, args)  # the restarted pods: the same command
    outputs = _wait(procs, 240)
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outputs]
    trained = [r["step"] for r in _records(out)]
    assert trained[trained.index(saved) + 1 :][:1] == [saved + 1] and trained[-1] == steps
    assert complete_checkpoints(out / "checkpoints")[-1][0] == steps
