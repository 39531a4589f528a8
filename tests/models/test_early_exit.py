"""The early-exit baseline (TSA's comparison at matched compute): exits, frozen states, calibration."""
import torch

from adaptex.graphs import early_exit as ee
from adaptex.graphs.lm_tasks import get_lm_task
from adaptex.graphs.recipes.tsa import TSATrainConfig
from adaptex.graphs.tsa import TSAConfig, TSADecoder

CFG = TSAConfig(vocab_size=32, d_model=32, num_heads=4, num_layers=4, d_ff=64, max_len=32, positions="learned",
                adaptive=False)


def test_no_exit_is_the_dense_decoder_and_exit_zero_saves_all_but_one_block():
    torch.manual_seed(0)
    m = TSADecoder(CFG).eval()
    ids = torch.randint(3, 32, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.int64)
    mask[1, :3] = 0
    with torch.no_grad():
        dense, _, _ = m(ids, mask, mode="dense")
    logits, exited = ee.early_exit_forward(m, ids, mask, threshold=2.0)  # never confident enough
    assert torch.allclose(logits, dense, atol=1e-5) and (exited == CFG.num_layers - 1).all()
    assert ee._ops_saved(exited, mask, CFG.num_layers) == 0.0
    logits, exited = ee.early_exit_forward(m, ids, mask, threshold=0.0)  # every token exits after block 0
    assert (exited == 0).all() and abs(ee._ops_saved(exited, mask, CFG.num_layers) - 0.75) < 1e-6
    assert torch.allclose(logits, ee.all_exit_logits(m, ids, mask)[0], atol=1e-5)


def test_an_exited_token_is_frozen_but_still_attended_to():
    torch.manual_seed(1)
    m = TSADecoder(CFG).eval()
    ids = torch.randint(3, 32, (1, 6))
    # a threshold at the median confidence of the first exit: about half the tokens leave there;
    # compare with a manual run that freezes the same tokens
    conf = ee.all_exit_logits(m, ids)[0].softmax(-1).amax(-1)
    logits, exited = ee.early_exit_forward(m, ids, None, threshold=float(conf.median()))
    assert 0 < (exited < CFG.num_layers - 1).sum() < exited.numel(), "pick a threshold where some tokens exit"
    h, bias = ee._embed(m, ids, None)
    empty = m.empty_past(1)[0]
    for li, blk in enumerate(m.blocks):
        h = torch.where((exited >= li)[..., None], ee._block(blk, h, bias, empty), h)
    want = ee.exit_logits(m, h)
    assert torch.allclose(logits, want, atol=1e-5)


def test_training_and_calibration_to_a_target():
    task = get_lm_task("copy")
    cfg = TSAConfig.from_dict({**CFG.to_dict(), "vocab_size": task.vocab_size})
    m = ee.train_early_exit(cfg, task, TSATrainConfig(steps=30, batch_size=32, warmup=5))
    thr = ee.calibrate_threshold(m, task, 0.3, n=200, iters=12)
    r = ee.evaluate_early_exit(m, task, thr, n=200)
    assert 0 <= thr <= 1 and 0 <= r["token_accuracy"] <= 1 and r["threshold"] == thr
    assert abs(r["ops_saved"] - 0.3) < 0.15  # calibrated on train samples, measured on held-out ones
