"""A strict XML reader for what a home gateway sends (UPnP descriptions and SOAP answers).

Built on the standard library's expat with every document type declaration
refused: no DTD means no entity can be declared, so nothing expands beyond
the five predefined entities and character references (no "billion laughs",
no quadratic blow-up) and nothing external is ever fetched.  defusedxml
would give the same guarantee with one more dependency; this module needs
none and is small enough to read.  Input size, element count and depth are
bounded too, so a hostile gateway costs at most a bounded parse.

The tree keeps only what UPnP needs: each element's namespace, local name,
text and children (attributes, comments and processing instructions are
dropped).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from xml.parsers import expat

from .errors import Malformed

MAX_SIZE = 64 * 1024
MAX_ELEMENTS = 2000
MAX_DEPTH = 32


@dataclass
class Element:
    namespace: str  # "" when the element is in no namespace
    name: str  # the local name, prefix dropped
    text: str = ""  # character data directly inside, stripped
    children: list[Element] = field(default_factory=list)

    def child(self, name: str) -> Element | None:
        """The first direct child called ``name`` (any namespace), or None."""
        return next((c for c in self.children if c.name == name), None)

    def child_text(self, name: str) -> str | None:
        """The text of the first direct child called ``name``, or None if there is none."""
        found = self.child(name)
        return None if found is None else found.text

    def iter(self, name: str) -> Iterator[Element]:
        """Every element called ``name`` below this one (any depth, document order)."""
        for c in self.children:
            if c.name == name:
                yield c
            yield from c.iter(name)


def parse(data: bytes, *, max_size: int = MAX_SIZE, max_elements: int = MAX_ELEMENTS,
          max_depth: int = MAX_DEPTH) -> Element:
    """The root element of ``data``; :class:`~nat.errors.Malformed` if the
    document is not well-formed, declares a document type, or exceeds a bound."""
    if len(data) > max_size:
        raise Malformed(f"an XML document of {len(data)} bytes (at most {max_size})")
    builder = _Builder(max_elements, max_depth)
    parser = expat.ParserCreate(namespace_separator=" ")
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    parser.StartDoctypeDeclHandler = _refuse_doctype
    parser.StartElementHandler = builder.start
    parser.EndElementHandler = builder.end
    parser.CharacterDataHandler = builder.text
    try:
        parser.Parse(data, True)
    except expat.ExpatError as exc:
        raise Malformed(f"not well-formed XML: {exc}") from None
    if builder.root is None:
        raise Malformed("an XML document without an element")
    return builder.root


def _refuse_doctype(*_args) -> None:
    raise Malformed("an XML document type declaration (refused: it could declare entities)")


class _Builder:
    """expat callbacks that build the :class:`Element` tree within the bounds."""

    def __init__(self, max_elements: int, max_depth: int):
        self.root: Element | None = None
        self._open: list[tuple[Element, list[str]]] = []
        self._count = 0
        self._max_elements = max_elements
        self._max_depth = max_depth

    def start(self, qualified: str, _attributes: dict) -> None:
        self._count += 1
        if self._count > self._max_elements:
            raise Malformed(f"an XML document with more than {self._max_elements} elements")
        if len(self._open) >= self._max_depth:
            raise Malformed(f"XML nested deeper than {self._max_depth} elements")
        namespace, _, name = qualified.rpartition(" ")
        element = Element(namespace, name)
        if self._open:
            self._open[-1][0].children.append(element)
        else:
            self.root = element
        self._open.append((element, []))

    def end(self, _qualified: str) -> None:
        element, chunks = self._open.pop()
        element.text = "".join(chunks).strip()

    def text(self, data: str) -> None:
        if self._open:
            self._open[-1][1].append(data)
