"""Hardware facts of the clusters the published samples were measured on.

Sources: the paper's Table V (arXiv 2509.22832) and the device names in the sample file
names. Where they disagree the measured device wins and the disagreement is recorded in
`notes`, which the training script copies into the manifest.

Bandwidths are GB/s (10^9 bytes per second), one direction. Peak FLOP rates are dense
fp16 tensor-core rates from the vendors' data sheets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from neox_perf.profile.facts import ClusterFacts, Link

GiB = 1 << 30


@dataclass(frozen=True)
class KnownCluster:
    facts: ClusterFacts
    sample_dir: str  # folder under the published samples
    device_string: str  # GPU name as spelled in the sample file names
    notes: Tuple[str, ...]


KNOWN_CLUSTERS: Dict[str, KnownCluster] = {
    # The published samples came from Perlmutter's 80 GB A100 nodes; the standard 40 GB nodes
    # (the paper's Table V) are the bundled description profiles/perlmutter-a100/cluster.yml.
    "perlmutter-a100-80gb": KnownCluster(
        facts=ClusterFacts(
            name="perlmutter-a100-80gb",
            gpu_name="NVIDIA A100-SXM4-80GB",
            gpu_memory_bytes=80 * GiB,
            gpus_per_node=4,
            # 12 NVLink3 links x 25 GB/s per direction; 4 GPUs fully connected (4 links per pair)
            intra_node_link=Link("NVLink 3.0", 300.0, 12),
            # 4 x 50 Gb/s NICs per node
            inter_node_link=Link("Slingshot-10", 25.0, 4),
            peak_fp16_tflops=312.0,
            hbm_bandwidth_gbps=2039.0,  # HBM2e of the 80 GB part
        ),
        sample_dir="Perlmutter",
        device_string="NVIDIAA100-SXM4-80GB",
        notes=(
            "GPU memory: the sample files were measured on NVIDIA A100-SXM4-80GB (80 GB HBM2e, "
            "2039 GB/s), Perlmutter's 80 GB nodes; its standard nodes (the paper's Table V) carry "
            "40 GB HBM2: use the perlmutter-a100 description for those.",
        ),
    ),
    "vista-gh200": KnownCluster(
        facts=ClusterFacts(
            name="vista-gh200",
            gpu_name="NVIDIA GH200 120GB",
            gpu_memory_bytes=96 * GiB,
            gpus_per_node=1,
            # one GPU per node: the only intra-node link is NVLink-C2C to the Grace CPU
            intra_node_link=Link("NVLink-C2C (CPU-GPU)", 450.0, 1),
            inter_node_link=Link("NDR InfiniBand", 50.0, 1),
            peak_fp16_tflops=989.0,
            hbm_bandwidth_gbps=4000.0,  # 96 GB HBM3
        ),
        sample_dir="Vista",
        device_string="NVIDIAGH200120GB",
        notes=(
            "GPU memory: the device reports itself as 'GH200 120GB' (120 GB is the Grace "
            "LPDDR5X); the GPU has 96 GB HBM3 (paper Table V), which is what is recorded.",
        ),
    ),
}
