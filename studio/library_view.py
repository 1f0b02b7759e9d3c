"""The list of models on the left: search, open a file, add a folder."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, QRect, QSize, Qt, Signal
from PySide6.QtGui import QFont, QKeySequence, QPainter, QPalette, QShortcut
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QVBoxLayout,
    QWidget,
)

from backend.models.gguf_info import format_file_size
from backend.models.library import ModelEntry, in_shown_order, search
from studio.widgets import plain_tooltip, secondary_label

__all__ = ["LibraryView"]

ENTRY_ROLE = Qt.ItemDataRole.UserRole + 1


class LibraryView(QWidget):
    selected = Signal(object)  # ModelEntry, or None when nothing is selected
    files_opened = Signal(list)  # [str]
    folder_added = Signal(str)
    rescan_requested = Signal()
    get_models_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._entries: list[ModelEntry] = []
        #: Where the file dialogs open: the folder of the last file opened, else home.
        self.start_dir = str(Path.home())

        self.search = QLineEdit()
        self.search.setPlaceholderText("Search models")
        self.search.setClearButtonEnabled(True)
        self.search.setAccessibleName("Search models")
        self.search.textChanged.connect(self._refilter)

        self.list = QListWidget()
        self.list.setAccessibleName("Models")
        self.list.setItemDelegate(_EntryDelegate(self.list))
        self.list.setUniformItemSizes(True)
        self.list.currentItemChanged.connect(self._on_current)
        self.list.setVerticalScrollMode(QListWidget.ScrollMode.ScrollPerPixel)

        self.empty_label = secondary_label("")
        self.empty_label.hide()
        self.get_models_button = QPushButton("&Get models from Hugging Face…")
        self.get_models_button.clicked.connect(self.get_models_requested)
        self.get_models_button.hide()

        self.open_button = QPushButton("&Open file…")
        self.open_button.setToolTip("Open a GGUF file (Ctrl+O)")
        self.open_button.clicked.connect(self.ask_for_files)
        self.folder_button = QPushButton("A&dd folder…")
        self.folder_button.setToolTip("Add a folder to look for GGUF files in")
        self.folder_button.clicked.connect(self.ask_for_folder)
        self.rescan_button = QPushButton()
        self.rescan_button.setIcon(self.style().standardIcon(QStyle.StandardPixmap.SP_BrowserReload))
        self.rescan_button.setToolTip("Look for models again (F5)")
        self.rescan_button.setAccessibleName("Rescan models")
        self.rescan_button.clicked.connect(self.rescan_requested)

        buttons = QHBoxLayout()
        buttons.addWidget(self.open_button)
        buttons.addWidget(self.folder_button)
        buttons.addStretch(1)
        buttons.addWidget(self.rescan_button)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.search)
        layout.addWidget(self.empty_label)
        layout.addWidget(self.get_models_button)
        layout.addWidget(self.list, 1)
        layout.addLayout(buttons)

        # Open (Ctrl+O) and Rescan (F5) are the File menu's: a second binding here made
        # both ambiguous, and Qt then runs neither.
        QShortcut(QKeySequence.StandardKey.Find, self, self._focus_search)
        # Down from the search box goes to the list, as in a launcher.
        self.search.returnPressed.connect(self.list.setFocus)

    # --- rendering ------------------------------------------------------------------------

    def set_entries(self, entries: list[ModelEntry], select: str | None = None) -> None:
        """Show `entries`; those shown already keep their places (a load must not move the
        model under the pointer), new ones come after them."""
        current = self.current_entry()
        self._entries = in_shown_order(entries, [entry.path for entry in self._entries])
        self._refilter(select=select or (current.path if current else None))

    def current_entry(self) -> ModelEntry | None:
        item = self.list.currentItem()
        entry: ModelEntry | None = item.data(ENTRY_ROLE) if item is not None else None
        return entry

    def select_path(self, path: str) -> bool:
        for row in range(self.list.count()):
            entry = self.list.item(row).data(ENTRY_ROLE)
            if entry is not None and entry.path == path:
                self.list.setCurrentRow(row)
                return True
        return False

    def entries(self) -> list[ModelEntry]:
        return [self.list.item(row).data(ENTRY_ROLE) for row in range(self.list.count())]

    # --- behaviour ----------------------------------------------------------------------------

    def _refilter(self, _text: str = "", select: str | None = None) -> None:
        current = self.current_entry()
        keep = select or (current.path if current is not None else None)
        shown = search(self._entries, self.search.text())
        self.list.blockSignals(True)
        self.list.clear()
        for entry in shown:
            item = QListWidgetItem(entry.name)
            item.setData(ENTRY_ROLE, entry)
            item.setToolTip(plain_tooltip(entry.path))
            self.list.addItem(item)
        self.list.blockSignals(False)
        if not (keep and self.select_path(keep)):
            self.list.setCurrentRow(-1)
            self.selected.emit(None)
        self.empty_label.setText("No models found yet. Get one from Hugging Face, open a GGUF "
                                 "file or add a folder." if not self._entries else "No model matches the search.")
        self.empty_label.setVisible(not shown)
        self.get_models_button.setVisible(not self._entries)

    def _on_current(self, current: QListWidgetItem | None,
                    _previous: QListWidgetItem | None) -> None:
        self.selected.emit(current.data(ENTRY_ROLE) if current is not None else None)

    def _focus_search(self) -> None:
        self.search.setFocus()
        self.search.selectAll()

    def ask_for_files(self) -> None:
        """Let the user pick GGUF files; `files_opened` says which."""
        paths, _ = QFileDialog.getOpenFileNames(self, "Open GGUF models", self.start_dir,
                                                "GGUF models (*.gguf);;All files (*)")
        if paths:
            self.start_dir = str(Path(paths[-1]).parent)
            self.files_opened.emit(paths)

    def ask_for_folder(self) -> None:
        """Let the user pick a folder of models; `folder_added` says which."""
        folder = QFileDialog.getExistingDirectory(self, "Add a folder of GGUF models",
                                                  self.start_dir)
        if folder:
            self.start_dir = folder
            self.folder_added.emit(folder)


class _EntryDelegate(QStyledItemDelegate):
    """Two lines per model: its name, then where it came from and its size."""

    def sizeHint(self, option: QStyleOptionViewItem,
                 index: QModelIndex | QPersistentModelIndex) -> QSize:
        height = option.fontMetrics.height()
        return QSize(200, int(height * 2.6))

    def paint(self, painter: QPainter, option: QStyleOptionViewItem,
              index: QModelIndex | QPersistentModelIndex) -> None:
        entry: ModelEntry | None = index.data(ENTRY_ROLE)
        opt = QStyleOptionViewItem(option)
        self.initStyleOption(opt, index)
        opt.text = ""
        style = opt.widget.style() if opt.widget else None
        if style is not None:
            style.drawControl(QStyle.ControlElement.CE_ItemViewItem, opt, painter, opt.widget)
        if entry is None:
            return
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        palette = option.palette
        text_role = QPalette.ColorRole.HighlightedText if selected else QPalette.ColorRole.Text
        rect = option.rect.adjusted(8, 3, -8, -3)
        line = option.fontMetrics.height()
        painter.save()
        name_font = QFont(option.font)
        name_font.setBold(True)
        painter.setFont(name_font)
        painter.setPen(palette.color(text_role))
        metrics = painter.fontMetrics()
        painter.drawText(QRect(rect.left(), rect.top(), rect.width(), line),
                         Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                         metrics.elidedText(entry.name, Qt.TextElideMode.ElideMiddle, rect.width()))
        painter.setFont(option.font)
        secondary = palette.color(text_role) if selected else palette.color(QPalette.ColorRole.PlaceholderText)
        painter.setPen(secondary)
        parts = [entry.source_label]
        if entry.detail:
            parts.append(entry.detail)
        parts.append(format_file_size(entry.size) if entry.exists else "missing")
        detail = " · ".join(parts)
        painter.drawText(QRect(rect.left(), rect.top() + int(line * 1.25), rect.width(), line),
                         Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                         painter.fontMetrics().elidedText(detail, Qt.TextElideMode.ElideMiddle,
                                                          rect.width()))
        painter.restore()
