"""The model runner's GPU-ready seams on plain data and on this CPU host (the device query faked where a GPU is
meant: this host has none): input buffers preallocated by size bucket and reused, pinned staging planned for a
GPU, and the pieces a piecewise graph capture would cut the forward into at the MoE layers."""

from __future__ import annotations

import torch

from expertmesh.serving.graph_capture import CAPTURES, Piece, choose_capture, pieces
from expertmesh.serving.input_buffers import InputBuffers, buckets_for, plan_for


def test_buckets_are_powers_of_two_up_to_the_step_budget():
    assert buckets_for(512) == [16, 32, 64, 128, 256, 512]
    assert buckets_for(100) == [16, 32, 64, 100] and buckets_for(8) == [8]


def test_a_step_fills_its_bucket_and_every_step_of_that_size_reuses_it():
    buffers = InputBuffers(64, plan_for(torch.device("cpu")))
    first = buffers.load(torch.arange(20)[None], torch.arange(20), torch.tensor([19]))
    second = buffers.load(torch.arange(5, 30)[None], torch.arange(25), torch.tensor([3, 24]))
    assert buffers.bucket(20) == buffers.bucket(25) == 32
    assert first.input_ids.data_ptr() == second.input_ids.data_ptr(), "the same storage, no allocation per step"
    assert second.input_ids.tolist() == [list(range(5, 30))] and second.positions.shape == (1, 25)
    assert second.logit_rows.tolist() == [3, 24]
    small = buffers.load(torch.arange(3)[None], torch.arange(3), torch.tensor([2]))
    assert small.input_ids.data_ptr() != first.input_ids.data_ptr() and buffers.bucket(3) == 16


def test_a_gpu_stages_its_inputs_in_pinned_memory_and_a_cpu_copies_directly():
    assert plan_for(torch.device("cuda", 0)).pinned_staging is True
    assert plan_for(torch.device("cpu")).pinned_staging is False


def test_the_forward_is_cut_at_each_moe_layer_into_pieces_a_graph_can_hold():
    assert pieces([1, 3]) == [Piece(None, 1), Piece(1, 3), Piece(3, None)]
    assert pieces([]) == [Piece(None, None)], "a model without MoE layers is one piece"
    assert len(pieces(range(61))) == 62, "61 MoE layers: 62 pieces"


def test_every_device_runs_eager_until_a_piecewise_capture_is_built_and_checked_on_a_gpu():
    assert choose_capture(torch.device("cpu")) == choose_capture(torch.device("cuda", 0)) == "eager"
    assert CAPTURES["eager"].run(16, lambda: torch.ones(2)).tolist() == [1.0, 1.0]
