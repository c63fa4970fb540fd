"""Which rows fed each update (issue 40): the fingerprints the invariance check takes of the model's inputs.

The check installs global module hooks in every run it starts (gaccum_check.recording): a row's
fingerprint must not depend on how far its batch padded it, and only the model's forward calls
in training count (not a loss module, not an evaluation under no_grad).
"""

import torch
from torch import nn

from gaccum_check.recording import record_call
from gaccum_check.rows import compare_rows, row_keys

ROW = [5, 9, 3]


def padded(rows, length, pad=0):
    return torch.tensor([row + [pad] * (length - len(row)) for row in rows])


def test_a_row_has_one_fingerprint_however_far_its_batch_pads_it():
    alone = row_keys((padded([ROW], 3),), {})
    assert alone == row_keys((padded([ROW, [7] * 6], 6),), {})[:1]
    assert row_keys((), {"input_ids": padded([ROW], 8, pad=-100)}) == alone
    # another pad id, told by the attention mask, or by the model's pad_token_id
    ids = padded([ROW, [4, 4, 4, 4, 4]], 5, pad=2)
    mask = ids.ne(2) | torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]).bool()
    assert row_keys((), {"input_ids": ids, "attention_mask": mask})[0] == alone[0]
    assert row_keys((ids,), {}, pad_values=(0, -100, 2))[0] == alone[0]
    assert row_keys((ids,), {})[0] != alone[0]  # a pad id it is not told of is data
    assert row_keys((padded([[5, 9, 4]], 3),), {}) != alone  # another row


def test_float_rows_padded_along_their_first_axis_have_one_fingerprint():
    # lesson 04's items: float ids with a feature axis, padded with -100 (gaccum_lib.data.pad_and_stack)
    short = torch.tensor([[[1.0], [2.0]]])
    long = torch.tensor([[[1.0], [2.0], [-100.0], [-100.0]], [[1.0], [2.0], [3.0], [4.0]]])
    assert row_keys((short,), {}) == row_keys((long,), {})[:1]
    pixels = torch.zeros(1, 3, 4, dtype=torch.uint8)  # unsigned: -100 is no pad value there
    pixels[0, 1] = 156
    assert row_keys((pixels,), {}) == row_keys((pixels[:, 1:2],), {})  # zero rows of pixels only


def test_rows_of_padding_only_carry_no_data_and_inputs_that_need_a_gradient_are_no_data():
    assert row_keys((padded([ROW, []], 3),), {}) == row_keys((padded([ROW], 3),), {})
    assert row_keys((torch.randn(2, 3, requires_grad=True),), {}) is None
    assert row_keys((), {"num_items_in_batch": torch.tensor(7)}) is None


def test_the_main_input_is_found_by_name_in_keywords_or_a_batch_dict():
    pixels = torch.arange(12.0).reshape(2, 6)
    by_name = row_keys((), {"labels": torch.tensor([1, 0]), "pixel_values": pixels})
    assert by_name == row_keys(({"pixel_values": pixels},), {}) == row_keys((pixels,), {})
    assert len(set(by_name)) == 2


def _train_two_updates():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))
    criterion = nn.CrossEntropyLoss()  # a module without parameters: not the model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [padded([[1, 2], [3]], 3), padded([[4, 5, 6]], 3), padded([[7]], 3), padded([[8, 9]], 3),
               padded([[2, 2]], 3)]
    for i, ids in enumerate(batches):
        criterion(model(ids), torch.zeros(len(ids), dtype=torch.long)).backward()
        if i % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                model(batches[0])  # an evaluation: not training
    return None


def test_the_recorder_keeps_each_updates_forward_calls_and_what_came_after_the_last():
    recorded = record_call(_train_two_updates)
    assert [len(calls) for calls in recorded["feeds"]] == [2, 2]
    assert [len(keys) for _, keys in recorded["feeds"][0]] == [2, 1]
    assert len(recorded["pending"]) == 1  # the fifth micro-batch, never stepped
    assert {tag for calls in recorded["feeds"] for tag, _ in calls} == {0}  # one module: the model
    same = [{"feeds": recorded["feeds"], "pending": recorded["pending"]}]
    assert compare_rows(same, same, 2) is None
