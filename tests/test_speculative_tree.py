"""Tree utilities and greedy verification on hand-made and random trees."""

from __future__ import annotations

import torch

from framework.speculative.tree import ancestor_mask, chain_tree, children_table, select_tree
from framework.speculative.verify import verify_greedy


def random_parents(bs: int, n: int, gen: torch.Generator) -> torch.Tensor:
    rows = [[-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)] for _ in range(bs)]
    return torch.tensor(rows)


def reference_mask(parents: torch.Tensor) -> torch.Tensor:
    bs, n = parents.shape
    mask = torch.zeros(bs, n, n, dtype=torch.bool)
    for b in range(bs):
        for i in range(n):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = int(parents[b, j])
    return mask


def test_ancestor_mask_matches_a_walk_up_the_tree():
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 8, 17, 33):
        parents = random_parents(5, n, gen)
        assert torch.equal(ancestor_mask(parents), reference_mask(parents)), n


def test_children_table_lists_valid_children_in_order():
    parents = torch.tensor([[-1, 0, 0, 1, 1, 0, 3]])
    valid = torch.tensor([[True, True, True, True, False, True, True]])
    table = children_table(parents, valid, 3)
    assert table[0, 0].tolist() == [1, 2, 5] and table[0, 1].tolist() == [3, -1, -1]
    assert table[0, 3].tolist() == [6, -1, -1] and (table[0, 4:] == -1).all()


def test_select_tree_keeps_parents_first_and_best_scores():
    roots = torch.tensor([7])
    # candidates: 0,1 children of the root; 2,3 children of 0; 4 child of 1; 5 child of 2
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2]])
    scores = torch.tensor([[-0.1, -2.0, -0.3, -3.0, -2.5, -0.4]])
    depths = torch.tensor([[1, 1, 2, 2, 2, 3]])
    tree = select_tree(roots, tokens, parents, scores, depths, num_nodes=5)
    assert tree.tokens.tolist() == [[7, 10, 11, 12, 15]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 3]] and tree.depths.tolist() == [[0, 1, 1, 2, 3]]


def test_greedy_verify_follows_the_argmax_path():
    # tree: root(0) -> 1 (tok 5), 2 (tok 6); 1 -> 3 (tok 8); 2 -> 4 (tok 9)
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 0, 1, 2]])
    tokens = torch.tensor([[4, 5, 6, 8, 9], [4, 5, 6, 8, 9]])
    tree = chain_tree(tokens, torch.ones_like(tokens, dtype=torch.bool))
    tree.parents, tree.depths = parents, torch.tensor([[0, 1, 1, 2, 2]] * 2)
    vocab = 12
    argmax = torch.tensor([[6, 0, 9, 0, 3], [5, 8, 0, 2, 0]])  # target token after each node
    logits = torch.nn.functional.one_hot(argmax, vocab).float().view(-1, vocab)
    res = verify_greedy(tree, logits, num_steps=2, max_children=2)
    # request 0: root->6 (node 2) -> 9 (node 4), bonus 3; request 1: root->5 (node 1) -> 8 (node 3), bonus 2
    assert res.accept_index.tolist() == [[0, 2, 4], [0, 1, 3]]
    assert res.accept_lens.tolist() == [3, 3] and res.bonus.tolist() == [3, 2]
    assert res.accept_tokens.view(2, 3).tolist() == [[6, 9, 3], [5, 8, 2]]


def walk_reference(tokens, parents, valid, predict, num_steps, max_children):
    """The accepted path by walking down from the root: at each node the first matching valid child."""
    path = [0]
    while len(path) <= num_steps:
        kids = [i for i in range(len(parents)) if parents[i] == path[-1] and valid[i]][:max_children]
        nxt = [i for i in kids if tokens[i] == predict[path[-1]]]
        if not nxt:
            break
        path.append(nxt[0])
    return path


def test_greedy_verify_equals_a_walk_on_random_trees():
    """Random trees with duplicate sibling tokens, invalid nodes and more children than max_children."""
    gen = torch.Generator().manual_seed(1)
    vocab = 3  # small: many matches, siblings sharing a token
    for n, max_children, num_steps in [(2, 1, 1), (8, 2, 3), (13, 3, 4), (21, 4, 6)]:
        bs = 16
        parents = random_parents(bs, n, gen)
        depths = torch.zeros(bs, n, dtype=torch.int64)
        for i in range(1, n):
            depths[:, i] = depths.gather(1, parents[:, i:i + 1])[:, 0] + 1
        valid = torch.rand(bs, n, generator=gen) < 0.85
        valid[:, 0] = True
        tokens = torch.randint(0, vocab, (bs, n), generator=gen)
        predict = torch.randint(0, vocab, (bs, n), generator=gen)
        tree = chain_tree(tokens, valid)
        tree.parents, tree.depths = parents, depths
        # a node past num_steps, or whose parent is invalid, can never be on a path
        res = verify_greedy(tree, torch.nn.functional.one_hot(predict, vocab).float().view(-1, vocab), num_steps,
                            max_children)
        for b in range(bs):
            ok = [bool(valid[b, i]) and (i == 0 or bool(valid[b, int(parents[b, i])])) for i in range(n)]
            path = walk_reference(tokens[b].tolist(), parents[b].tolist(), ok, predict[b].tolist(), num_steps,
                                  max_children)
            assert res.accept_index[b].tolist() == path + [-1] * (num_steps + 1 - len(path)), (n, b)
            assert int(res.accept_lens[b]) == len(path)


def test_host_trees_carry_the_ancestor_mask_of_their_parents():
    """host_tree builds each node's ancestors on the host (an int64 of bits, the sign bit at 64 nodes): equal to
    ancestor_mask of the uploaded parents, padding included; wider trees leave it to tree_mask."""
    from framework.speculative.tree import host_tree, tree_mask

    gen = torch.Generator().manual_seed(1)
    for n in (2, 8, 33, 64, 65):
        rows = []
        for b in range(3):
            size = int(torch.randint(0, n, (1,), generator=gen))  # nodes after the root; the rest padding
            nodes = []
            for i in range(1, size + 1):
                parent = int(torch.randint(0, i, (1,), generator=gen))
                nodes.append((int(torch.randint(0, 100, (1,), generator=gen)), parent,
                              1 + (nodes[parent - 1][2] if parent else 0)))
            rows.append(nodes)
        tree = host_tree(rows, n, torch.arange(3))
        assert (tree.mask is None) == (n > 64)
        assert torch.equal(tree_mask(tree), reference_mask(tree.parents)), n
        assert tree_mask(tree) is tree.mask  # computed once
