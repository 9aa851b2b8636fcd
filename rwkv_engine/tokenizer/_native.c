/*
 * Native byte trie for the RWKV World tokenizer (rwkv_engine.tokenizer._native).
 *
 * One type, Trie(tokens), where tokens[i] is the byte string of token id i, or None for ids
 * without text. Two methods:
 *
 *   Trie.encode(buffer) -> list[int]   greedy longest-prefix match over the bytes
 *   Trie.decode(ids) -> bytes          concatenation of the token bytes
 *
 * This module is the fast path of rwkv_engine/tokenizer/world.py; world.py holds the pure-Python
 * twin with identical results, documents the behaviour, and turns the plain ValueError / TypeError
 * raised here into TokenizerError. Plain CPython C API, no other dependency.
 *
 * Layout: node 0 is the root. A node with more than DENSE_MIN children keeps them in a dense row
 * of 256 child indices (0 = no child; the root is never a child); the others keep a short sorted
 * run of (label, child) edges, searched linearly. For the World vocab that is ~116k nodes, ~3k
 * dense rows (~3 MB) and ~0.6 MB of edges.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define DENSE_MIN 8
/* Inputs at least this long are matched with the GIL released. */
#define NOGIL_MIN_BYTES 8192

typedef struct {
    int32_t token;   /* id of the token spelled by the path to this node, -1 if none */
    uint32_t first;  /* dense: row index in `dense`; sparse: index of the first edge */
    uint16_t count;  /* number of children */
    uint16_t is_dense;
} Node;

typedef struct {
    PyObject_HEAD
    Node *nodes;
    Py_ssize_t n_nodes;
    uint8_t *labels;     /* sparse edges: label bytes, sorted per node */
    uint32_t *targets;   /* sparse edges: child node index */
    uint32_t *dense;     /* dense rows, 256 entries each */
    Py_ssize_t vocab_size;
    Py_ssize_t *offsets; /* vocab_size + 1 offsets into blob */
    char *blob;          /* all token bytes, by id */
    PyObject **ints;     /* int objects 0 .. vocab_size-1, one reference each */
} TrieObject;

/* ---- building ------------------------------------------------------------------------- */

/* Temporary linked form: children of a node are a singly linked sibling list sorted by label. */
typedef struct {
    int32_t *token;
    uint32_t *child;
    uint32_t *sibling;
    uint8_t *label;
    Py_ssize_t n, cap;
} Builder;

static int
builder_grow(Builder *b)
{
    Py_ssize_t cap = b->cap ? b->cap * 2 : 4096;
    int32_t *token = PyMem_Realloc(b->token, cap * sizeof(int32_t));
    if (token) b->token = token;
    uint32_t *child = PyMem_Realloc(b->child, cap * sizeof(uint32_t));
    if (child) b->child = child;
    uint32_t *sibling = PyMem_Realloc(b->sibling, cap * sizeof(uint32_t));
    if (sibling) b->sibling = sibling;
    uint8_t *label = PyMem_Realloc(b->label, cap);
    if (label) b->label = label;
    if (!token || !child || !sibling || !label) {
        PyErr_NoMemory();
        return -1;
    }
    b->cap = cap;
    return 0;
}

static Py_ssize_t
builder_new_node(Builder *b, uint8_t label)
{
    if (b->n == b->cap && builder_grow(b) < 0)
        return -1;
    if (b->n >= (Py_ssize_t)UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "vocabulary too large for the native trie");
        return -1;
    }
    Py_ssize_t k = b->n++;
    b->token[k] = -1;
    b->child[k] = 0;
    b->sibling[k] = 0;
    b->label[k] = label;
    return k;
}

static void
builder_free(Builder *b)
{
    PyMem_Free(b->token);
    PyMem_Free(b->child);
    PyMem_Free(b->sibling);
    PyMem_Free(b->label);
}

/* Child of `node` with `label`, created (in sorted position) if missing. -1 on error. */
static Py_ssize_t
builder_child(Builder *b, Py_ssize_t node, uint8_t label)
{
    uint32_t prev = 0, cur = b->child[node];
    while (cur && b->label[cur] < label) {
        prev = cur;
        cur = b->sibling[cur];
    }
    if (cur && b->label[cur] == label)
        return cur;
    Py_ssize_t k = builder_new_node(b, label);
    if (k < 0)
        return -1;
    b->sibling[k] = cur;
    if (prev)
        b->sibling[prev] = (uint32_t)k;
    else
        b->child[node] = (uint32_t)k;
    return k;
}

static int
trie_build(TrieObject *self, PyObject *seq)
{
    Py_ssize_t V = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Builder b = {0};
    int ok = -1;

    if (V > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "vocabulary too large for the native trie");
        return -1;
    }
    self->vocab_size = V;
    self->offsets = PyMem_Malloc((V + 1) * sizeof(Py_ssize_t));
    self->ints = PyMem_Calloc(V ? V : 1, sizeof(PyObject *));
    if (!self->offsets || !self->ints) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < V; i++) {
        PyObject *t = items[i];
        self->offsets[i] = total;
        if (t == Py_None)
            continue;
        if (!PyBytes_Check(t)) {
            PyErr_Format(PyExc_TypeError, "token %zd must be bytes or None, not %.100s",
                         i, Py_TYPE(t)->tp_name);
            return -1;
        }
        if (PyBytes_GET_SIZE(t) == 0) {
            PyErr_Format(PyExc_ValueError, "token %zd is empty", i);
            return -1;
        }
        total += PyBytes_GET_SIZE(t);
    }
    self->offsets[V] = total;
    self->blob = PyMem_Malloc(total ? total : 1);
    if (!self->blob) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < V; i++) {
        self->ints[i] = PyLong_FromSsize_t(i);
        if (!self->ints[i])
            return -1;
        if (items[i] != Py_None)
            memcpy(self->blob + self->offsets[i], PyBytes_AS_STRING(items[i]),
                   PyBytes_GET_SIZE(items[i]));
    }

    if (builder_new_node(&b, 0) < 0)  /* the root */
        goto done;
    for (Py_ssize_t i = 0; i < V; i++) {
        if (items[i] == Py_None)
            continue;
        const uint8_t *s = (const uint8_t *)PyBytes_AS_STRING(items[i]);
        Py_ssize_t len = PyBytes_GET_SIZE(items[i]);
        Py_ssize_t node = 0;
        for (Py_ssize_t j = 0; j < len; j++) {
            node = builder_child(&b, node, s[j]);
            if (node < 0)
                goto done;
        }
        if (b.token[node] >= 0) {
            PyErr_Format(PyExc_ValueError, "tokens %d and %zd have the same bytes",
                         (int)b.token[node], i);
            goto done;
        }
        b.token[node] = (int32_t)i;
    }

    /* Compact: same node indices, children as dense rows or sorted edge runs. */
    Py_ssize_t n = b.n, n_dense = 0, n_edges = 0;
    self->nodes = PyMem_Calloc(n, sizeof(Node));
    if (!self->nodes) {
        PyErr_NoMemory();
        goto done;
    }
    self->n_nodes = n;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t count = 0;
        for (uint32_t c = b.child[k]; c; c = b.sibling[c])
            count++;
        self->nodes[k].token = b.token[k];
        self->nodes[k].count = (uint16_t)count;
        if (count > DENSE_MIN) {
            self->nodes[k].is_dense = 1;
            self->nodes[k].first = (uint32_t)n_dense++;
        }
        else {
            self->nodes[k].first = (uint32_t)n_edges;
            n_edges += count;
        }
    }
    self->labels = PyMem_Malloc(n_edges ? n_edges : 1);
    self->targets = PyMem_Malloc((n_edges ? n_edges : 1) * sizeof(uint32_t));
    self->dense = PyMem_Calloc(n_dense ? n_dense * 256 : 1, sizeof(uint32_t));
    if (!self->labels || !self->targets || !self->dense) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        Node *nd = &self->nodes[k];
        Py_ssize_t e = 0;
        for (uint32_t c = b.child[k]; c; c = b.sibling[c], e++) {
            if (nd->is_dense) {
                self->dense[(size_t)nd->first * 256 + b.label[c]] = c;
            }
            else {
                self->labels[nd->first + e] = b.label[c];
                self->targets[nd->first + e] = c;
            }
        }
    }
    ok = 0;
done:
    builder_free(&b);
    return ok;
}

/* ---- the type ------------------------------------------------------------------------- */

static void
Trie_dealloc(TrieObject *self)
{
    if (self->ints) {
        for (Py_ssize_t i = 0; i < self->vocab_size; i++)
            Py_XDECREF(self->ints[i]);
        PyMem_Free(self->ints);
    }
    PyMem_Free(self->nodes);
    PyMem_Free(self->labels);
    PyMem_Free(self->targets);
    PyMem_Free(self->dense);
    PyMem_Free(self->offsets);
    PyMem_Free(self->blob);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Trie_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"tokens", NULL};
    PyObject *tokens;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Trie", kwlist, &tokens))
        return NULL;
    PyObject *seq = PySequence_Fast(tokens, "tokens must be a sequence of bytes or None");
    if (!seq)
        return NULL;
    TrieObject *self = (TrieObject *)type->tp_alloc(type, 0);
    if (self && trie_build(self, seq) < 0)
        Py_CLEAR(self);
    Py_DECREF(seq);
    return (PyObject *)self;
}

static inline uint32_t
trie_child(const TrieObject *t, const Node *nd, uint8_t c)
{
    if (nd->is_dense)
        return t->dense[(size_t)nd->first * 256 + c];
    const uint8_t *lab = t->labels + nd->first;
    for (uint32_t k = 0; k < nd->count; k++) {
        if (lab[k] == c)
            return t->targets[nd->first + k];
    }
    return 0;
}

/* Greedy longest match of s[0:n] into *out (grown with realloc). Runs without the GIL.
 * Returns the number of ids, -1 when out of memory, or -2 - offset when the byte at `offset`
 * starts no token. */
static Py_ssize_t
trie_match(const TrieObject *t, const uint8_t *s, Py_ssize_t n, int32_t **out)
{
    Py_ssize_t cap = n / 3 + 16, k = 0, i = 0;
    int32_t *ids = malloc(cap * sizeof(int32_t));
    if (!ids)
        return -1;
    const Node *nodes = t->nodes;
    while (i < n) {
        const Node *nd = nodes;  /* root */
        int32_t best = -1;
        Py_ssize_t end = i, j = i;
        while (j < n) {
            uint32_t c = trie_child(t, nd, s[j]);
            if (!c)
                break;
            nd = &nodes[c];
            j++;
            if (nd->token >= 0) {
                best = nd->token;
                end = j;
            }
            if (!nd->count)
                break;
        }
        if (best < 0) {
            free(ids);
            return -2 - i;
        }
        if (k == cap) {
            cap *= 2;
            int32_t *grown = realloc(ids, cap * sizeof(int32_t));
            if (!grown) {
                free(ids);
                return -1;
            }
            ids = grown;
        }
        ids[k++] = best;
        i = end;
    }
    *out = ids;
    return k;
}

static PyObject *
Trie_encode(TrieObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *s = view.buf;
    Py_ssize_t n = view.len;
    int32_t *ids = NULL;
    Py_ssize_t k;
    if (n >= NOGIL_MIN_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        k = trie_match(self, s, n, &ids);
        Py_END_ALLOW_THREADS
    }
    else {
        k = trie_match(self, s, n, &ids);
    }
    if (k < 0) {
        if (k == -1)
            PyErr_NoMemory();
        else
            PyErr_Format(PyExc_ValueError, "byte 0x%02x at offset %zd starts no token",
                         (unsigned)s[-2 - k], -2 - k);
        PyBuffer_Release(&view);
        return NULL;
    }
    PyBuffer_Release(&view);
    PyObject *list = PyList_New(k);
    if (list) {
        for (Py_ssize_t m = 0; m < k; m++) {
            PyObject *v = self->ints[ids[m]];
            Py_INCREF(v);
            PyList_SET_ITEM(list, m, v);
        }
    }
    free(ids);
    return list;
}

static PyObject *
Trie_decode(TrieObject *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "token ids must be a sequence of ints");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *result = NULL;
    int32_t *ids = PyMem_Malloc((n ? n : 1) * sizeof(int32_t));
    if (!ids) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t m = 0; m < n; m++) {
        PyObject *o = items[m];
        long v;
        int overflow = 0;
        if (PyLong_Check(o)) {
            v = PyLong_AsLongAndOverflow(o, &overflow);
        }
        else {
            PyObject *index = PyNumber_Index(o);
            if (!index) {
                PyErr_Format(PyExc_TypeError, "token id at position %zd is %.100s, not an int",
                             m, Py_TYPE(o)->tp_name);
                goto done;
            }
            v = PyLong_AsLongAndOverflow(index, &overflow);
            Py_DECREF(index);
        }
        if (v == -1 && PyErr_Occurred())
            goto done;
        if (overflow || v < 0 || v >= self->vocab_size) {
            PyObject *repr = PyObject_Repr(o);
            if (repr) {
                PyErr_Format(PyExc_ValueError,
                             "token id %U at position %zd is outside [0, %zd)",
                             repr, m, self->vocab_size);
                Py_DECREF(repr);
            }
            goto done;
        }
        ids[m] = (int32_t)v;
        total += self->offsets[v + 1] - self->offsets[v];
    }
    result = PyBytes_FromStringAndSize(NULL, total);
    if (!result)
        goto done;
    char *p = PyBytes_AS_STRING(result);
    for (Py_ssize_t m = 0; m < n; m++) {
        Py_ssize_t a = self->offsets[ids[m]], len = self->offsets[ids[m] + 1] - a;
        memcpy(p, self->blob + a, len);
        p += len;
    }
done:
    PyMem_Free(ids);
    Py_DECREF(seq);
    return result;
}

static PyObject *
Trie_get_vocab_size(TrieObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->vocab_size);
}

static PyObject *
Trie_get_n_nodes(TrieObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->n_nodes);
}

static PyMethodDef Trie_methods[] = {
    {"encode", (PyCFunction)Trie_encode, METH_O,
     "encode(data) -> list[int]\n\nGreedy longest-prefix match of a bytes-like object."},
    {"decode", (PyCFunction)Trie_decode, METH_O,
     "decode(ids) -> bytes\n\nConcatenated bytes of the token ids (ids without text give b'')."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Trie_getset[] = {
    {"vocab_size", (getter)Trie_get_vocab_size, NULL, "number of ids (len(tokens))", NULL},
    {"n_nodes", (getter)Trie_get_n_nodes, NULL, "number of trie nodes, root included", NULL},
    {NULL},
};

static PyTypeObject TrieType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rwkv_engine.tokenizer._native.Trie",
    .tp_doc = "Trie(tokens)\n\nByte trie over tokens[id] (bytes, or None for ids without text).",
    .tp_basicsize = sizeof(TrieObject),
    .tp_itemsize = 0,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Trie_new,
    .tp_dealloc = (destructor)Trie_dealloc,
    .tp_methods = Trie_methods,
    .tp_getset = Trie_getset,
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "rwkv_engine.tokenizer._native",
    .m_doc = "Native byte trie for the RWKV World tokenizer.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    if (PyType_Ready(&TrieType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (!m)
        return NULL;
    Py_INCREF(&TrieType);
    if (PyModule_AddObject(m, "Trie", (PyObject *)&TrieType) < 0) {
        Py_DECREF(&TrieType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
