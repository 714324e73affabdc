"""Builds dashboards/tfprofd.json with grafana-foundation-sdk (Grafana's official dashboards-as-code SDK).

    python dashboards/build.py          # rewrite tfprofd.json
    python dashboards/build.py --check  # exit 1 if tfprofd.json differs from what this builds
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders import barchart, dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import BigValueColorMode, GraphDrawStyle
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DataTransformerConfig,
    DynamicConfigValue,
    VariableRefresh,
)

OUTPUT = Path(__file__).with_name("tfprofd.json")
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
HOST = 'instance=~"$instance"'
GPU = f'{HOST}, gpu=~"$gpu"'
JOB = f'{HOST}, training_job=~"$training_job"'
STRAGGLER = 1.2  # prometheus/tfprofd-alerts.yaml's TfprofdStraggler threshold (a test keeps them equal)
IDLE_STRAGGLER = 0.2  # its GPU signal: this much less busy than the job's median worker (a test keeps them equal)


def query(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").ref_id(ref).datasource(DATASOURCE)
    return q.instant() if instant else q.range()


def series(title: str, unit: str, *queries: prometheus.Dataquery, description: str = "", width: int = 8,
           maximum: float | None = None) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).unit(unit).datasource(DATASOURCE).span(width).height(8)
             .description(description).fill_opacity(10).draw_style(GraphDrawStyle.LINE).min(0))
    if maximum is not None:
        panel = panel.max(maximum)
    for q in queries:
        panel = panel.with_target(q)
    return panel


def variable(name: str, label: str, expr: str) -> dashboard.QueryVariable:
    return (dashboard.QueryVariable(name).label(label).datasource(DATASOURCE)
            .query({"query": expr, "refId": f"{name}-query"}).refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True).include_all(True).all_value(".*"))


def per_worker(title: str, unit: str, worker: str, behind: Callable[[str], str], description: str,
               maximum: float | None = None) -> timeseries.Panel:
    """A panel of each worker of a job (``worker``, by training_job, worker and instance) against the job's
    median worker (dashed); a worker ``behind(median)`` selects, in a job of two or more, is drawn again in red."""
    median = f"quantile by (training_job) (0.5, {worker})"
    workers = f"count by (training_job) (count by (training_job, worker) ({worker}))"
    straggler = f"{worker} and ({behind(median)}) and on (training_job) ({workers} >= 2)"
    red = [DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": "red"}),
           DynamicConfigValue(id_val="custom.lineWidth", value=4),
           DynamicConfigValue(id_val="custom.showPoints", value="always")]
    dashed = [DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
              DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": "text"})]
    return (series(title, unit,
                   query(worker, "{{training_job}} {{worker}} on {{instance}}"),
                   query(median, "median of {{training_job}}", "B"),
                   query(straggler, "straggler: {{training_job}} {{worker}} on {{instance}}", "C"),
                   description=description, maximum=maximum)
            .override_by_query("B", dashed).override_by_query("C", red))


WORKER = "training_job, worker, instance"
JOB_SELECTOR = 'training_job=~"$training_job"'


def worker_step_time(rate: str) -> timeseries.Panel:
    """Each worker's mean step time, its job's median, and the stragglers marked (every host: a job's workers
    are compared with each other wherever they run)."""
    worker = (f"(sum by ({WORKER}) (rate(tfprofd_training_step_duration_seconds_sum{{{JOB_SELECTOR}}}[{rate}])) "
              f"/ sum by ({WORKER}) (rate(tfprofd_training_step_duration_seconds_count{{{JOB_SELECTOR}}}[{rate}]) "
              f"> 0))")
    return per_worker("Step time per worker", "s", worker,
                      lambda median: f"{worker} / on (training_job) group_left {median} >= {STRAGGLER}",
                      description=f"Mean step time of each worker of the job, on every host, against the median of "
                                  f"the job's workers (dashed). A worker {STRAGGLER}x the median or slower in a job "
                                  f"of two or more workers is drawn again in red; held 5 minutes, that is the "
                                  f"TfprofdStraggler alert, which captures a profile on the straggler's host.")


def worker_gpu_busy(rate: str) -> timeseries.Panel:
    """Each worker's GPUs' utilization, its job's median worker, and the stragglers marked: in a synchronous job
    the waiting workers' GPUs spin in the all-reduce while the straggler's idle (step times are equal there)."""
    worker = (f"(avg by ({WORKER}) (tfprofd_gpu_utilization_ratio * on (instance, gpu) group_right "
              f"tfprofd_gpu_job_info{{{JOB_SELECTOR}}}) and on ({WORKER}) "
              f"(rate(tfprofd_training_step_duration_seconds_count{{{JOB_SELECTOR}}}[{rate}]) > 0))")
    return per_worker("GPU busy per worker", "percentunit", worker,
                      lambda median: f"{median} - on (training_job) group_right () {worker} >= {IDLE_STRAGGLER}",
                      description=f"Utilization of each stepping worker's GPUs (NVML; their mean where a worker has "
                                  f"several), on every host, against the job's median worker (dashed). In a "
                                  f"synchronous job every worker waits for the slowest at each all-reduce, so step "
                                  f"times are equal: the waiting workers' GPUs spin in the collective and the "
                                  f"straggler's idle. A worker {IDLE_STRAGGLER * 100:.0f} points or more under the "
                                  f"median in a job of two or more workers is drawn again in red; held 5 minutes "
                                  f"(over 5-minute means), that is the TfprofdStraggler alert.", maximum=1)


def build() -> dashboard.Dashboard:
    rate = "$__rate_interval"
    d = (dashboard.Dashboard("tfprofd: GPU training host").uid("tfprofd-host").tags(["tfprofd", "gpu", "training"])
         .description("GPU, host and training throughput from tfprofd, with captures and their bottlenecks.")
         .time("now-1h", "now").refresh("30s").tooltip(DashboardCursorSync.CROSSHAIR).editable()
         .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
         .with_variable(variable("instance", "Host", "label_values(tfprofd_build_info, instance)"))
         .with_variable(variable("gpu", "GPU", 'label_values(tfprofd_gpu_info{instance=~"$instance"}, gpu)'))
         .with_variable(variable("training_job", "Training job",
                                 'label_values(tfprofd_training_up{instance=~"$instance"}, training_job)'))
         .annotation(dashboard.AnnotationQuery().name("Captures").datasource(DATASOURCE).enable(True)
                     .icon_color("orange")
                     .expr(f"max by (instance, training_job, kind) (tfprofd_capture_bottleneck_info{{{JOB}}}) "
                           f"and on(instance, training_job) "
                           f"(time() - tfprofd_capture_last_timestamp_seconds{{{JOB}}} < 60)")))

    d = d.with_row(dashboard.Row("Training"))
    d = d.with_panel(series(
        "Throughput", "suffix: samples/s",
        query(f"sum by (instance, training_job) (rate(tfprofd_training_samples_total{{{JOB}}}[{rate}]))",
              "{{training_job}} on {{instance}}"),
        description="Training samples per second, the unit that compares runs with different batch sizes."))
    d = d.with_panel(series(
        "Step time", "s",
        query(f"histogram_quantile(0.5, sum by (training_job, le) "
              f"(rate(tfprofd_training_step_duration_seconds_bucket{{{JOB}}}[{rate}])))", "p50 {{training_job}}"),
        query(f"histogram_quantile(0.95, sum by (training_job, le) "
              f"(rate(tfprofd_training_step_duration_seconds_bucket{{{JOB}}}[{rate}])))", "p95 {{training_job}}",
              "B"),
        description="Step duration measured by the hook."))
    d = d.with_panel(worker_step_time(rate))
    d = d.with_panel(worker_gpu_busy(rate))
    job_gpu = f"tfprofd_gpu_job_info{{{JOB}}}"
    d = d.with_panel(table.Panel().title("Job to GPU and pod").unit("none").datasource(DATASOURCE).span(8).height(8)
                     .description("Which training job runs on which GPU (NVML process list joined with the hook) "
                                  "and, on Kubernetes, in which pod (the kubelet's PodResources).")
                     .with_target(query(f"max by (instance, gpu, training_job, worker, namespace, pod) "
                                        f"(({job_gpu} * on (instance, gpu) group_left (namespace, pod) "
                                        f"tfprofd_gpu_pod_info) or {job_gpu})", instant=True)))
    d = d.with_panel(stat.Panel().title("Latest capture: input-bound").unit("percentunit").datasource(DATASOURCE)
                     .span(8).height(6).color_mode(BigValueColorMode.BACKGROUND)
                     .description("Share of step time waiting for input in the job's latest analysed capture.")
                     .with_target(query(f"tfprofd_capture_input_bound_ratio{{{JOB}}}", "{{training_job}}",
                                        instant=True)))
    d = d.with_panel(table.Panel().title("Latest capture: bottleneck").unit("none").datasource(DATASOURCE)
                     .span(8).height(6).description("Bottleneck named by the job's latest analysed capture.")
                     .with_target(query(f"max by (instance, training_job, kind) "
                                        f"(tfprofd_capture_bottleneck_info{{{JOB}}})", instant=True)))
    breakdown = f"tfprofd_capture_step_breakdown_seconds{{{JOB}}}"
    d = d.with_panel(barchart.Panel().title("Step breakdown: latest capture and its baseline").unit("s")
                     .datasource(DATASOURCE).span(8).height(8).x_field("part")
                     .description("Time per step in each part of the step, in the job's latest analysed capture "
                                  "and in its baseline capture (taken while the job trained steadily): the part "
                                  "that grew is where the time went.")
                     .with_target(query(f'sum by (part) ({breakdown[:-1]}, capture="latest"}})', "latest",
                                        instant=True).format("table"))
                     .with_target(query(f'sum by (part) ({breakdown[:-1]}, capture="baseline"}})', "baseline",
                                        "B", instant=True).format("table"))
                     .with_transformation(DataTransformerConfig(id_val="joinByField", options={"byField": "part"}))
                     .with_transformation(DataTransformerConfig(id_val="organize", options={
                         "excludeByName": {"Time": True, "Time 1": True, "Time 2": True},
                         "renameByName": {"Value #A": "latest", "Value #B": "baseline"}})))
    d = d.with_panel(series(
        "Rules active", "none",
        query(f"max by (rule) (tfprofd_rule_active{{{HOST}}})", "{{rule}}"),
        description="1 while a tfprofd rule fires (low GPU utilization, throughput drop, bottlenecks...).",
        maximum=1))

    d = d.with_row(dashboard.Row("GPU"))
    d = d.with_panel(series("GPU utilization", "percentunit",
                            query(f"tfprofd_gpu_utilization_ratio{{{GPU}}}", "GPU {{gpu}} {{instance}}"),
                            query(f"tfprofd_gpu_memory_utilization_ratio{{{GPU}}}", "GPU {{gpu}} memory", "B"),
                            maximum=1))
    d = d.with_panel(series("SM activity", "percentunit",
                            query(f"tfprofd_gpu_sm_activity_ratio{{{GPU}}}", "GPU {{gpu}} {{instance}}"),
                            query(f"tfprofd_mig_sm_activity_ratio{{{GPU}}}",
                                  "GPU {{gpu}} MIG {{gpu_instance_id}} {{instance}}", "B"),
                            query(f"tfprofd_gpu_tensor_activity_ratio{{{GPU}}}", "GPU {{gpu}} tensor cores", "C"),
                            description="Fraction of SMs busy (GPM, Hopper and newer; per MIG instance too). "
                                        "Utilization beside it only says a kernel ran: 100% utilization with low "
                                        "SM activity is a GPU kept busy by small kernels.", maximum=1))
    d = d.with_panel(series("GPU memory used", "bytes",
                            query(f"tfprofd_gpu_memory_used_bytes{{{GPU}}}", "GPU {{gpu}} {{instance}}"),
                            query(f"max(tfprofd_gpu_memory_total_bytes{{{GPU}}})", "total", "B")))
    d = d.with_panel(series("GPU power", "watt", query(f"tfprofd_gpu_power_watts{{{GPU}}}", "GPU {{gpu}}")))
    d = d.with_panel(series("GPU temperature", "celsius",
                            query(f"tfprofd_gpu_temperature_celsius{{{GPU}}}", "GPU {{gpu}}")))
    d = d.with_panel(series("GPU clocks", "hertz",
                            query(f"tfprofd_gpu_sm_clock_hertz{{{GPU}}}", "SM GPU {{gpu}}"),
                            query(f"tfprofd_gpu_memory_clock_hertz{{{GPU}}}", "memory GPU {{gpu}}", "B")))
    d = d.with_panel(table.Panel().title("GPU to pod").unit("none").datasource(DATASOURCE).span(8).height(8)
                     .description("Which Kubernetes pod and container holds each GPU or MIG device (the kubelet's "
                                  "PodResources API; empty off Kubernetes).")
                     .with_target(query(f"max by (instance, gpu, uuid, namespace, pod, container) "
                                        f"(tfprofd_gpu_pod_info{{{GPU}}})", instant=True)))
    d = d.with_panel(series("Clock throttle reasons", "none",
                            query(f"max by (gpu, reason) (tfprofd_gpu_clock_event_reason_active{{{GPU}}})",
                                  "GPU {{gpu}} {{reason}}"),
                            description="1 while the reason holds the GPU's clocks down.", maximum=1))

    d = d.with_row(dashboard.Row("Host"))
    d = d.with_panel(series(
        "CPU by mode", "percentunit",
        query(f"sum by (mode) (rate(tfprofd_cpu_seconds_total{{{HOST}, mode!=\"idle\"}}[{rate}])) "
              f"/ scalar(max(tfprofd_cpus{{{HOST}}}))", "{{mode}}"),
        description="Share of all CPUs per mode (idle left out); iowait high with low GPU use means I/O-bound."))
    d = d.with_panel(series("Memory", "bytes",
                            query(f"tfprofd_memory_used_bytes{{{HOST}}}", "used {{instance}}"),
                            query(f"tfprofd_memory_available_bytes{{{HOST}}}", "available {{instance}}", "B")))
    d = d.with_panel(series("Disk throughput", "Bps",
                            query(f"sum by (device) (rate(tfprofd_disk_read_bytes_total{{{HOST}}}[{rate}]))",
                                  "read {{device}}"),
                            query(f"sum by (device) (rate(tfprofd_disk_written_bytes_total{{{HOST}}}[{rate}]))",
                                  "written {{device}}", "B")))
    d = d.with_panel(series("Network throughput", "Bps",
                            query(f"sum by (device) (rate(tfprofd_network_receive_bytes_total{{{HOST}}}[{rate}]))",
                                  "receive {{device}}"),
                            query(f"sum by (device) (rate(tfprofd_network_transmit_bytes_total{{{HOST}}}[{rate}]))",
                                  "transmit {{device}}", "B")))
    d = d.with_panel(series("CPU iowait and load", "percentunit",
                            query(f"tfprofd_cpu_iowait_ratio{{{HOST}}}", "iowait {{instance}}"),
                            query(f"tfprofd_cpu_utilization_ratio{{{HOST}}}", "busy {{instance}}", "B"),
                            maximum=1))

    d = d.with_row(dashboard.Row("tfprofd"))
    d = d.with_panel(series("Collector health", "none",
                            query(f"min by (collector) (tfprofd_collector_success{{{HOST}}})", "{{collector}}"),
                            description="1 when the collector's latest sample succeeded.", maximum=1))
    d = d.with_panel(series("Captures", "none",
                            query(f"sum by (trigger, status) (increase(tfprofd_captures_total{{{HOST}}}[1h]))",
                                  "{{trigger}} {{status}}"),
                            description="Captures finished in the last hour, by trigger and status."))
    d = d.with_panel(series("Hook reports", "reqps",
                            query(f"sum (rate(tfprofd_hook_reports_total{{{HOST}}}[{rate}]))", "accepted"),
                            query(f"sum by (reason) (rate(tfprofd_hook_reports_rejected_total{{{HOST}}}[{rate}]))",
                                  "rejected {{reason}}", "B"),
                            query(f"sum (rate(tfprofd_hook_reports_dropped_total{{{HOST}}}[{rate}]))",
                                  "dropped by the kernel", "C"),
                            query(f"sum (rate(tfprofd_hook_reports_unsent_total{{{HOST}}}[{rate}]))",
                                  "refused to the hooks", "D"),
                            description="Training-hook datagrams accepted, rejected (by reason), dropped by the "
                                        "kernel on a full UDP socket (see the agent's log), and refused to the "
                                        "hooks (the Unix socket full, or no agent), as their later reports told, "
                                        "per second."))
    return d.build()


def render() -> str:
    return json.dumps(build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if OUTPUT.read_text() != text:
            print(f"{OUTPUT} is stale: run python dashboards/build.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
