"""The word-pair head: a text is the max over its adjacent token pairs' codes, a page the max
over its most word-like cells' read pairs, so a page that reads "a b" matches the query "a b"
and not "b a"; the dual encoder built with it trains every parameter in one step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vltrain.data.tokenizer import SPECIAL_TOKENS
from vltrain.models.dual_encoder import DualEncoder
from vltrain.models.presets import text_config, vision_config
from vltrain.models.word_pairs import Reading, WordPairHead
from vltrain.objectives.reading import ReadingLoss
from vltrain.scaling import flops

V, D, SIDE = 20, 16, 4
S = len(SPECIAL_TOKENS)


def _head(**kw: object) -> WordPairHead:
    """Every tokenizer id its own class (V classes)."""
    torch.manual_seed(0)
    ids = torch.arange(V)
    return WordPairHead(8, V, D, SIDE, token_class=ids, specials=S, norm=nn.BatchNorm2d(128), **kw)


def _pair(head: WordPairHead, a: int, b: int) -> torch.Tensor:
    return F.relu(head.first[a] + head.second[b] + head.bias)


def test_text_code_is_the_max_over_adjacent_real_token_pairs() -> None:
    head = _head()
    bos, eos, pad = 1, 2, 0
    ids = torch.tensor([[bos, 5, 9, 7, eos, pad], [bos, 6, eos, pad, pad, pad]])
    mask = (ids != pad).long()
    code = head.text(ids, mask)
    want = torch.stack([_pair(head, 5, 9), _pair(head, 9, 7)]).amax(0)
    torch.testing.assert_close(code[0], want)
    torch.testing.assert_close(code[1], _pair(head, 6, V))  # one token: it ends a line
    swapped = head.text(torch.tensor([[bos, 9, 5, eos]]), None)
    assert not torch.allclose(swapped[0], _pair(head, 5, 9))  # order is kept
    torch.testing.assert_close(swapped[0], _pair(head, 9, 5))
    # padding the mask hides is no token even when its id is a word's
    hidden = head.text(torch.tensor([[bos, 5, 9, 7]]), torch.tensor([[1, 1, 1, 0]]))
    torch.testing.assert_close(hidden[0], _pair(head, 5, 9))


def test_texts_code_tokens_by_their_reading_class() -> None:
    """With a reading vocabulary, a text's token is coded by its class; a token no page shows
    has the last row of its own (C + 1), never background / end of line (C)."""
    torch.manual_seed(0)
    token_class = torch.full((V,), 3 + 1)  # classes: ids 7, 9, 11 -> 0, 1, 2; the rest unread
    token_class[torch.tensor([7, 9, 11])] = torch.arange(3)
    head = WordPairHead(8, 3, D, SIDE, token_class=token_class, specials=S, norm=nn.Identity())
    assert head.first.shape == (3 + 2, D)
    code = head.text(torch.tensor([[1, 7, 9, 2], [1, 9, 13, 2]]))
    torch.testing.assert_close(code[0], _pair(head, 0, 1))
    torch.testing.assert_close(code[1], _pair(head, 1, 4))  # 13 is unread: its own row
    with pytest.raises(ValueError, match="token_class"):
        WordPairHead(8, 3, D, SIDE, token_class=token_class + 1, specials=S, norm=nn.Identity())


def test_page_code_keeps_the_pairs_its_cells_read() -> None:
    head = _head(keep=3)
    big = 30.0
    tokens = torch.full((1, SIDE * SIDE, V + 1), 0.0)
    tokens[..., V] = big  # background everywhere ...
    tokens[0, 0, 5] = tokens[0, 1, 9] = 2 * big  # ... but cell 0 reads 5, cell 1 reads 9
    context = torch.zeros(1, SIDE * SIDE, 8 + 128)
    context[0, 0, 0] = context[0, 1, 1] = 1.0  # the next-token reader tells the cells apart
    head.read_next = nn.Linear(8 + 128, V + 1, bias=False)
    with torch.no_grad():
        head.read_next.weight.zero_()
        head.read_next.weight[9, 0] = big  # cell 0: next is 9
        head.read_next.weight[V, 1] = big  # cell 1: the end of the line
    code = head.code(Reading(tokens, context, head.read_next))[0]
    query = head.text(torch.tensor([[1, 5, 9, 2]]))[0]
    reverse = head.text(torch.tensor([[1, 9, 5, 2]]))[0]
    cos = F.cosine_similarity
    assert torch.all(code >= query - 1e-4)  # the page's max holds the pair "5 9"
    with torch.no_grad():
        assert float(cos(code, query, dim=0)) > float(cos(code, reverse, dim=0)) + 0.05


@pytest.mark.parametrize("pair_code", ["add", "product"])
def test_dual_encoder_word_pairs_trains_every_parameter(pair_code: str) -> None:
    torch.manual_seed(0)
    v_cfg = vision_config(
        "tiny_cnn", image_size=32, pool="none", stem_channels=(8, 8, 16), width=24
    )
    reads = list(range(S, V))  # the reading vocabulary: every id but the specials
    enc = DualEncoder(
        v_cfg,
        text_config("tiny", vocab_size=V),
        D,
        head="word_pairs",
        reading_tokens=reads,
        specials=S,
        pair_code=pair_code,
    )
    assert not hasattr(enc, "text") and not hasattr(enc, "vision_proj")
    images, ids = torch.rand(3, 3, 32, 32), torch.randint(S, V, (3, 5))
    emb, read = enc.encode_image_read(images)
    txt = enc.encode_text(ids, torch.ones_like(ids))
    assert emb.shape == txt.shape == (3, D)
    # unit norm, or zero: at init a reader's flat softmax averages the code rows, and relu
    # of that average (below the negative bias) is zero until the tower reads
    norms = emb.norm(dim=-1)
    assert bool((((norms - 1).abs() < 1e-5) | (norms == 0)).all()), norms
    torch.testing.assert_close(enc.encode_image(images), emb)
    assert read.tokens.shape == (3, 16, len(reads) + 1)
    targets = torch.randint(0, len(reads) + 1, (3, 2, 16))
    loss, _ = ReadingLoss(len(reads), 1.0)(read, targets)
    ((emb @ txt.T).sum() + loss).backward()
    missing = [n for n, p in enc.named_parameters() if p.grad is None]
    assert not missing, missing  # DDP without find_unused_parameters needs all of them
    acct = flops.dual_encoder_flops(enc, 5)
    fwd = flops.measure_flops(lambda: (enc.encode_image(images), enc.encode_text(ids)))
    assert acct.forward == pytest.approx(fwd["total"] / 3, rel=0.05)
    with pytest.raises(ValueError, match="pool 'none'"):
        DualEncoder(v_cfg, text_config("tiny", vocab_size=V), D, head="word_pairs")
    pooled = vision_config("tiny_cnn", image_size=32, pool="max")
    with pytest.raises(ValueError, match="pool 'none'"):
        DualEncoder(
            pooled, text_config("tiny", vocab_size=V), D, head="word_pairs", reading_tokens=reads
        )
    with pytest.raises(ValueError, match="pool 'none'"):
        DualEncoder(v_cfg, text_config("tiny", vocab_size=V), D)  # nothing would read it


def test_product_code_sums_pair_products_and_separates_pairs_sharing_a_token() -> None:
    """pair_code="product": a pair's code is F[a] * S[b], a side the sum over its pairs (or
    kept cells), so a page's score for a query counts its cells that read the query's pair, and
    a pair that shares only one token with the query scores near zero."""
    head = _head(pair_code="product")
    assert head.bias is None
    # its rows are centred over the classes a page shows (the last row: a token none shows)
    first, second = (r.detach() for r in head.rows())
    for rows in (first, second):
        torch.testing.assert_close(rows[:-1].mean(0), torch.zeros(D), atol=1e-6, rtol=0)
    code = head.text(torch.tensor([[1, 5, 9, 7, 2, 0]]), torch.tensor([[1, 1, 1, 1, 1, 0]]))
    torch.testing.assert_close(code[0], first[5] * second[9] + first[9] * second[7])
    torch.testing.assert_close(head.text(torch.tensor([[1, 6, 2]]))[0], first[6] * second[V])
    # a page whose cells 0 and 1 read "5 9" and cell 2 reads "3 end"; the rest background
    head.keep = 3
    big = 30.0
    tokens = torch.zeros(1, SIDE * SIDE, V + 1)
    tokens[..., V] = big
    tokens[0, 0, 5] = tokens[0, 1, 5] = tokens[0, 2, 3] = 2 * big
    context = torch.zeros(1, SIDE * SIDE, 8 + 128)
    context[0, :2, 0] = context[0, 2, 1] = 1.0
    head.read_next = nn.Linear(8 + 128, V + 1, bias=False)
    with torch.no_grad():
        head.read_next.weight.zero_()
        head.read_next.weight[9, 0] = big
        head.read_next.weight[V, 1] = big
        page = head.code(Reading(tokens, context, head.read_next))[0]
        torch.testing.assert_close(page, 2 * first[5] * second[9] + first[3] * second[V])

    # with wide random rows the product separates what the relu sum only halves
    def shared_one(pair_code: str) -> float:
        torch.manual_seed(1)
        wide = WordPairHead(
            8,
            50,
            4096,
            SIDE,
            token_class=torch.arange(50),
            specials=S,
            norm=nn.Identity(),
            pair_code=pair_code,
        )
        with torch.no_grad():
            ab, ac = wide.text(torch.tensor([[1, 10, 11, 2], [1, 10, 12, 2]]))
        return float(F.cosine_similarity(ab, ac, dim=0))

    assert abs(shared_one("product")) < 0.1 < 0.3 < shared_one("add")
    with pytest.raises(ValueError, match="pair_code"):
        _head(pair_code="concat")


def test_a_last_token_without_eos_still_pairs() -> None:
    head = _head()
    torch.testing.assert_close(head.text(torch.tensor([[1, 6]]))[0], _pair(head, 6, V))
    torch.testing.assert_close(head.text(torch.tensor([[5, 9]]))[0], _pair(head, 5, 9))


def test_the_head_builds_on_the_meta_device() -> None:
    """FLOP budgets build the model on the meta device (`vltrain.scaling.budget`)."""
    with torch.device("meta"):
        head = WordPairHead(
            8, V, D, SIDE, token_class=torch.arange(V), specials=S, norm=nn.Identity()
        )
    assert head.first.is_meta
